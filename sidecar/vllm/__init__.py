"""The vLLM side: a worker class an unmodified vLLM loads with `--worker-cls`. Imports no MLX."""
