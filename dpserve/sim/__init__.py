"""`dpserve sim`: a replica that behaves like a vLLM OpenAI server as the router sees it, without a model."""
