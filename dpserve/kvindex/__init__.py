"""The KV-block index: which replica holds which prompt blocks, from their KV-cache events."""
