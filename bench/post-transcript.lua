-- wrk script: a multi-step agent's 31st turn (`ab.sh CELL=jsontranscript`): post.lua's
-- question, then 30 earlier steps, each the assistant's `get_weather` call and its tool result
-- of 4,000 bytes (the same request every time: every result is one turnguard has seen after
-- the first request), ~126 KB in all. What turnguard spends on a transcript's earlier results
-- (bench/RESULTS.md, issue 13, twenty-fifth session).
local steps, result_bytes = 30, 4000
local filler = "The forecast for the next hours, line by line. "
local messages = {'{"role":"user","content":"What is the weather in San Francisco?"}'}
for i = 1, steps do
  local id = string.format("call_step%04d", i)
  local text = string.rep(filler, math.ceil(result_bytes / #filler)):sub(1, result_bytes - 8)
    .. string.format(" step %02d", i)
  messages[#messages + 1] = '{"role":"assistant","content":null,"tool_calls":[{"id":"' .. id
    .. '","type":"function","function":{"name":"get_weather","arguments":"{\\"location\\":\\"San Francisco\\"}"}}]}'
  messages[#messages + 1] = '{"role":"tool","tool_call_id":"' .. id .. '","content":"' .. text .. '"}'
end
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer sk-bench"
wrk.body = '{"model":"gpt-4o","stream":false,"messages":[' .. table.concat(messages, ",")
  .. '],"tools":[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"location":{"type":"string"},"units":{"type":"string"}}}}}]}'
