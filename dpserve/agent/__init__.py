"""`dpserve agent`: one per GPU host, serving that host's NVML readings (JSON and DCGM-like metrics)."""
