wrk.method = "POST"
wrk.body = '{"model":"dpserve-tiny","prompt":"Hello, my name is","max_tokens":16,"stream":false}'
wrk.headers["Content-Type"] = "application/json"
