"""The benchmark: the sidecar against mlx-lm side by side (run.py), and the scale-out scenario
(group.py). A development tool next to the serving package, never part of it (sidecar/ imports
nothing from here): `python -m bench [flags]` from the repository root, or `make bench ARGS=...`.

Nothing is imported here: `python -m bench` restarts itself with the chosen BLAS (blas.py) before
it loads MLX, and the vLLM venv runs vllm_driver.py, which needs no MLX.
"""
