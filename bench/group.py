"""`python -m bench --scale-out`: the same greedy workload on 1 rank and on a 2-rank group
(tensor parallel, pipeline parallel) over loopback, through real servers and the reference
scheduler. Reports tokens/s, the mean step time and, per step, the time rank 0 spends in the
group's own collectives (the call broadcast and the token share; the model's all-reduces or
send/recv are inside its forward and counted in the step time). Tokens must equal the 1-rank run.

On one machine the ranks share its cores and talk over loopback: this measures correctness and
the group's overhead, not a speed-up (that needs one Mac per rank).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from bench.sides import ServerProcess, SidecarSide, free_port, requests_for

NOTE = ("scale-out on one machine: both ranks share its cores and talk over loopback, so this is about "
        "correctness and per-step overhead, not speed-up")
# (label, model, flags): each group run is compared with the 1-rank run of the same model.
CONFIGS = [
    ("1 rank", "builtin:tiny", {}),
    ("TP=2", "builtin:tiny", {"tensor_parallel": 2}),
    ("1 rank", "builtin:tiny-qwen2", {}),
    ("PP=2", "builtin:tiny-qwen2", {"pipeline_parallel": 2}),
    ("1 rank", "builtin:small", {}),
    ("TP=2", "builtin:small", {"tensor_parallel": 2}),
]
_METRIC = re.compile(rb"^(mlx_worker_steps_total|mlx_worker_group_collective_seconds_total)\s+([0-9.eE+-]+)\s*$", re.M)


def _counters(side: SidecarSide) -> dict[str, float]:
    conn = http.client.HTTPConnection("127.0.0.1", side.server.port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        data = conn.getresponse().read()
    finally:
        conn.close()
    return {m.group(1).decode(): float(m.group(2)) for m in _METRIC.finditer(data)}


def _readyz_state(port: int) -> str | None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/readyz")
        return json.loads(conn.getresponse().read()).get("state")
    except (OSError, ValueError):
        return None
    finally:
        conn.close()


class _Group:
    """Rank 0 as a ServerProcess (HTTP), rank 1 as a plain process, joined by a loopback hostfile."""

    def __init__(self, model: str, home: str | None, flags: dict[str, Any], workdir: Path):
        self.hosts = workdir / f"hosts-{free_port()}.json"
        self.hosts.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(2)]))
        self.leader = ServerProcess(model, home, extra=flags, log_dir=str(workdir))
        self.follower: subprocess.Popen | None = None

    def start(self) -> ServerProcess:
        env = {**os.environ, "MLX_HOSTFILE": str(self.hosts)}
        self.follower = subprocess.Popen(self.leader.argv(), env={**env, "MLX_RANK": "1"},
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        saved = {k: os.environ.get(k) for k in ("MLX_HOSTFILE", "MLX_RANK")}
        os.environ.update(MLX_HOSTFILE=str(self.hosts), MLX_RANK="0")  # ServerProcess passes its environment on
        try:
            server = self.leader.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        deadline = time.monotonic() + 120
        while _readyz_state(server.port) in (None, "forming"):  # /healthz answers while the group forms
            if time.monotonic() > deadline:
                raise RuntimeError(f"the group did not form within 120 s:\n{server.log_tail()}")
            time.sleep(0.1)
        return server

    def stop(self) -> None:
        self.leader.stop()
        if self.follower is not None:
            try:
                self.follower.wait(20)
            except subprocess.TimeoutExpired:
                self.follower.kill()
                self.follower.wait(10)


def run_config(model: str, flags: dict[str, Any], home: str | None, workdir: Path, *, requests: int,
               prompt_len: int, new_tokens: int) -> dict[str, Any]:
    group = _Group(model, home, flags, workdir) if flags else None
    server = group.start() if group else ServerProcess(model, home, log_dir=str(workdir)).start()
    side = None
    try:
        side = SidecarSide(server, 256, max_num_seqs=requests, max_num_batched_tokens=requests * prompt_len)
        prompts = [[(7 * i + 13 * r) % 400 + 3 for i in range(prompt_len)] for r in range(requests)]
        side.run(requests_for(prompts, new_tokens), tag="warm-up")  # every shape once: compile and caches
        before = _counters(side)
        result, _ = side.run(requests_for(prompts, new_tokens), tag="measure")
        after = _counters(side)
    finally:
        if side is not None:
            side.close()
        (group.stop() if group else server.stop())
    steps = max(1.0, after.get("mlx_worker_steps_total", 0) - before.get("mlx_worker_steps_total", 0))
    collective = after.get("mlx_worker_group_collective_seconds_total", 0.0) - before.get(
        "mlx_worker_group_collective_seconds_total", 0.0)
    return {"tokens_per_s": result.total_tokens / result.wall_s, "step_ms": 1e3 * result.wall_s / steps,
            "collective_ms_per_step": 1e3 * collective / steps if flags else 0.0, "steps": int(steps),
            "tokens": list(result.tokens.values())}


def run_group_bench(home: str | None = None, *, quick: bool = False, configs: list | None = None,
                    log: Callable[[str], None] | None = None) -> dict[str, Any]:
    say = log or (lambda s: print(s, file=sys.stderr))
    configs = configs or (CONFIGS[:4] if quick else CONFIGS)
    n, plen, new = (4, 32, 16) if quick else (8, 64, 32)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="sidecar-bench-group-") as tmp:
        base: dict[str, dict[str, Any]] = {}
        for label, model, flags in configs:
            t0 = time.monotonic()
            r = run_config(model, flags, home, Path(tmp), requests=n, prompt_len=plen, new_tokens=new)
            ref = base.setdefault(model, r)
            r.update(label=label, model=model, tokens_equal=r["tokens"] == ref["tokens"],
                     ratio=r["tokens_per_s"] / ref["tokens_per_s"])
            say(f"[scale-out] {model} {label}: {r['tokens_per_s']:.1f} tok/s ({time.monotonic() - t0:.0f}s)")
            rows.append({k: v for k, v in r.items() if k != "tokens"})
    return {"note": NOTE, "workload": {"requests": n, "prompt_len": plen, "new_tokens": new}, "rows": rows,
            "load_average": os.getloadavg()[0], "cpu_count": os.cpu_count()}


def render(doc: dict[str, Any]) -> str:
    head = f"{'model':20} {'ranks':7} {'tok/s':>8} {'vs 1 rank':>9} {'step ms':>8} {'group ms/step':>13} tokens"
    lines = [f"note: {doc['note']}",
             f"load average {doc['load_average']:.1f} on {doc['cpu_count']} cores (other processes skew every figure)",
             head, "-" * len(head)]
    for r in doc["rows"]:
        lines.append(f"{r['model']:20} {r['label']:7} {r['tokens_per_s']:8.1f} {r['ratio']:9.3f} {r['step_ms']:8.2f} "
                     f"{r['collective_ms_per_step']:13.3f} {'equal' if r['tokens_equal'] else 'DIFFER'}")
    return "\n".join(lines)


def group_bench_cli(home: str | None, quick: bool, json_path: str) -> int:
    doc = run_group_bench(home, quick=quick)
    out = Path(json_path).with_name("scale-out.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(render(doc))
    print(f"json: {out}")
    return 0 if all(r["tokens_equal"] for r in doc["rows"]) else 1
