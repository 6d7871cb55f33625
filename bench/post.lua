-- wrk script: the non-stream tool-call request (the mock answers a ~1 KB tool call).
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer sk-bench"
wrk.body = '{"model":"gpt-4o","stream":false,"messages":[{"role":"user","content":"What is the weather in San Francisco?"}],"tools":[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"location":{"type":"string"},"units":{"type":"string"}}}}}]}'
