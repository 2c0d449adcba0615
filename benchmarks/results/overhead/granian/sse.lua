wrk.method = "POST"
wrk.body = '{"model":"dpserve-tiny","prompt":"Hello, my name is","max_tokens":32,"stream":true}'
wrk.headers["Content-Type"] = "application/json"
