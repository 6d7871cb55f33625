-- wrk script: a chat turn's second round, as a multi-step agent sends it: post.lua's request
-- followed by the assistant's `get_weather` call and its tool result, with a call id of its
-- own per request (`call_<thread>_<n>`), so every request carries a tool result turnguard
-- has not seen and journals it (tool_results row, `agent.tool-returned` event, the
-- released-at lookup).
local counter = 0
local thread_id = tostring(math.random(1, 1000000000))
function request()
  counter = counter + 1
  local id = "call_" .. thread_id .. "_" .. counter
  local headers = {}
  headers["Content-Type"] = "application/json"
  headers["Authorization"] = "Bearer sk-bench"
  return wrk.format("POST", nil, headers, '{"model":"gpt-4o","stream":false,"messages":[{"role":"user","content":"What is the weather in San Francisco?"},{"role":"assistant","content":null,"tool_calls":[{"id":"' .. id .. '","type":"function","function":{"name":"get_weather","arguments":"{\\"location\\":\\"San Francisco\\"}"}}]},{"role":"tool","tool_call_id":"' .. id .. '","content":"{\\"temp_c\\":18,\\"sky\\":\\"fog\\"}"}],"tools":[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"location":{"type":"string"},"units":{"type":"string"}}}}}]}')
end
