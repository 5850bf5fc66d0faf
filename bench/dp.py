"""`python -m bench --data-parallel`: vLLM's OpenAI server with `--data-parallel-size 2` over two
sidecars against `--data-parallel-size 1` over the first of the same two (sidecar/vllm/dp.py).
Runs only when the vLLM venv exists (`make install-vllm`).

Reported per run: tokens/s in total and per replica (each sidecar's own generation counter), the
sidecars' mean compute per step, and the wall time per step around it (the worker class, HTTP and
vLLM's engine loop: the overhead a step pays outside the model). On one machine both replicas
share its cores, so DP=2 cannot be faster here: this shows correctness (every request's tokens
equal to the DP=1 run's) and overhead. On two Macs each replica has its own GPU, so total tokens/s
should approach twice DP=1's while the per-replica figures stay DP=1's.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from bench.blas import without_preload
from bench.report import write_json
from bench.sides import ServerProcess, free_port
from bench.vllm_engine import ROOT, vllm_python
from sidecar.models.export import model_dir

_METRIC = re.compile(r"^(mlx_worker_generation_tokens_total|mlx_worker_step_duration_seconds_(?:sum|count))"
                     r"(?:\{[^}]*\})? (\S+)$", re.M)


def _counters(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, value in _METRIC.findall(httpx.get(f"{url}/metrics", timeout=10).text):
        out[name] = out.get(name, 0.0) + float(value)
    return out


def _completion(api: str, prompt: list[int], max_tokens: int) -> list[int]:
    r = httpx.post(f"{api}/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": max_tokens,
                   "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}, timeout=1800)
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


def _serve(py: Path, mdir: str, urls: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", mdir, "--worker-cls",
           "sidecar.vllm.worker.MLXSidecarWorker", "--additional-config", json.dumps({"mlx_sidecar": {"urls": urls}}),
           "--data-parallel-size", str(len(urls)), "--host", "127.0.0.1", "--port", str(port), "--block-size", "16",
           "--kv-cache-memory-bytes", str(64 << 20), "--max-model-len", "512", "--max-num-seqs", "16",
           "--max-num-batched-tokens", "256", "--enforce-eager", "--served-model-name", "m"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**without_preload(os.environ), "PYTHONPATH": str(ROOT)})
    api = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 1200
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{api}/health", timeout=2).status_code == 200:
                return proc, api
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(log.read_text()[-2000:])
        time.sleep(1)


def _run(py: Path, mdir: str, servers: list[ServerProcess], prompts: list[list[int]], max_tokens: int,
         log: Path) -> dict[str, Any]:
    proc, api = _serve(py, mdir, [s.url for s in servers], log)
    try:
        _completion(api, prompts[0][:4], 2)  # warm-up
        before = [_counters(s.url) for s in servers]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            tokens = list(pool.map(lambda p: _completion(api, p, max_tokens), prompts))
        wall = time.perf_counter() - t0
        after = [_counters(s.url) for s in servers]
    finally:
        proc.terminate()
        proc.wait(120)
    replicas = []
    for b, a in zip(before, after):
        d = {k: a.get(k, 0.0) - b.get(k, 0.0) for k in a}
        steps = d.get("mlx_worker_step_duration_seconds_count", 0.0)
        replicas.append({"tokens": d.get("mlx_worker_generation_tokens_total", 0.0), "steps": steps,
                         "tok_s": d.get("mlx_worker_generation_tokens_total", 0.0) / wall,
                         "compute_per_step_ms": 1e3 * d.get("mlx_worker_step_duration_seconds_sum", 0.0) / max(steps, 1),
                         "wall_per_step_ms": 1e3 * wall / max(steps, 1)})
    return {"wall_s": wall, "tok_s": len(prompts) * max_tokens / wall, "replicas": replicas, "tokens": tokens}


def run_dp_bench(home: str | None = None, *, quick: bool = False, model: str = "builtin:tiny") -> dict[str, Any]:
    py = vllm_python()
    if py is None:
        return {"skipped": "no .venv-vllm: `make install-vllm`"}
    n, max_tokens = (8, 16) if quick else (16, 64)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(8, 64))] for _ in range(n)]
    servers = [ServerProcess(model, home).start(timeout=600) for _ in range(2)]
    try:
        with tempfile.TemporaryDirectory(prefix="sidecar-bench-dp-") as tmp:
            mdir = str(model_dir(model, home, dest=tmp))
            dp1 = _run(py, mdir, servers[:1], prompts, max_tokens, Path(tmp) / "dp1.log")
            dp2 = _run(py, mdir, servers, prompts, max_tokens, Path(tmp) / "dp2.log")
    finally:
        for s in servers:
            s.stop()
    return {"model": model, "requests": n, "max_tokens": max_tokens, "dp1": dp1, "dp2": dp2,
            "tokens_equal": dp1["tokens"] == dp2["tokens"],
            "both_replicas_served": all(r["tokens"] > 0 for r in dp2["replicas"])}


def dp_bench_cli(home: str | None, quick: bool, json_path: str) -> int:
    doc = run_dp_bench(home, quick=quick)
    if "skipped" in doc:
        print(f"data parallel: not run ({doc['skipped']})")
        return 0
    write_json(json_path.replace("bench.json", "data-parallel.json"), doc)
    print(f"vLLM data parallel over sidecars ({doc['model']}, {doc['requests']} requests x {doc['max_tokens']} "
          "tokens, one machine: the replicas share its cores)")
    for name in ("dp1", "dp2"):
        r = doc[name]
        per = ", ".join(f"replica {i}: {x['tok_s']:.1f} tok/s, {x['steps']:.0f} steps, compute "
                        f"{x['compute_per_step_ms']:.1f} ms / wall {x['wall_per_step_ms']:.1f} ms per step"
                        for i, x in enumerate(r["replicas"]))
        print(f"  {name.upper()}: {r['tok_s']:.1f} tok/s in total ({per})")
    print(f"  tokens equal between DP=1 and DP=2: {doc['tokens_equal']}; both replicas served: "
          f"{doc['both_replicas_served']}")
    return 0 if doc["tokens_equal"] and doc["both_replicas_served"] else 1
