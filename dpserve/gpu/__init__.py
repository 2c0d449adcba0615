"""Per-GPU telemetry through NVML: the sampler, where replicas run, and the plain samples."""
