-- wrk script: post.lua's request with a run of its own per request (`Turnguard-Run:
-- bench-<thread>-<n>`), so turnguard journals each as run round 0 with durable records.
local counter = 0
local thread_id = tostring(math.random(1, 1000000000))
function request()
  counter = counter + 1
  local headers = {}
  headers["Content-Type"] = "application/json"
  headers["Authorization"] = "Bearer sk-bench"
  headers["Turnguard-Run"] = "bench-" .. thread_id .. "-" .. counter
  return wrk.format("POST", nil, headers, '{"model":"gpt-4o","stream":false,"messages":[{"role":"user","content":"What is the weather in San Francisco?"}],"tools":[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"location":{"type":"string"},"units":{"type":"string"}}}}}]}')
end
