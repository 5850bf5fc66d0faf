"""The worker: MLXWorker and its lifecycle, memory budget, sleep, KV-group validation, profiling."""
