"""`make bench-serve`: vLLM + the sidecar against vllm-mlx and mlx_lm.server, with vLLM's own client.

Every side serves the same model (all started first, one at a time, with their start-up time);
`vllm bench serve` (random dataset, greedy, `--ignore-eos`) then runs against each in turn at each
concurrency, for `--rounds` rounds, so a busy spell on the machine hits every side alike. Printed side by side: output tokens/s (completed
requests x output length: the client's re-tokenised count is wrong for a server that streams
several tokens per chunk), median TTFT and TPOT, each side's ratio to the reference side, and the
CPU seconds each side's processes spent per output token (on a Mac the forward is on the GPU: this
is the host cost that stays), and for the sides with a sidecar the share of the time its MLX thread
waited for a call while steps ran (bench/idle.py: at most the device's idle time). JSON with
every run goes to `--json`.

Sides (each only when installed): `sidecar` (vLLM's OpenAI server with the sidecar's platform
plugin: async scheduling), `sidecar-sync` (the same, `--no-async-scheduling`), `worker-cls`
(plain vLLM, `--worker-cls` only), `vllm-mlx` (.venv-vllm-mlx: vllm-mlx 0.6.0
`serve --continuous-batching`) and `mlx-lm` (`mlx_lm.server`, which needs two request fields of its
own: `extra_body`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Sequence

from bench.idle import IdleProbe

ROOT = Path(__file__).resolve().parent.parent
PY, VLLM_PY, VLLM_MLX = ROOT / ".venv/bin/python", ROOT / ".venv-vllm/bin/python", ROOT / ".venv-vllm-mlx/bin/vllm-mlx"
SIDES = ("sidecar", "sidecar-sync", "worker-cls", "vllm-mlx", "mlx-lm")
_TICK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_cpu_seconds(pid: int) -> float:
    """utime + stime of pid and every live descendant (/proc; threads are counted in their process)."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    kids.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/stat") as f:
                v = f.read().rsplit(")", 1)[1].split()
            total += (int(v[11]) + int(v[12]) + int(v[13]) + int(v[14])) / _TICK  # own + waited-for children
        except (OSError, IndexError, ValueError):
            pass
        todo += kids.get(p, [])
    return total


class Side:
    """One server (or two: the sidecar and vLLM in front of it), started once, benchmarked in turns."""

    def __init__(self, name: str, args: argparse.Namespace, paths: dict[str, str], log_dir: Path):
        self.name, self.args, self.paths, self.log_dir = name, args, paths, log_dir
        self.procs: list[subprocess.Popen] = []
        self.port = free_port()
        self.served = "bench" if name in ("sidecar", "sidecar-sync", "worker-cls") else paths["weights"]
        self.ready_seconds: float | None = None
        self.sidecar_url: str | None = None  # the sidecar behind vLLM, for its MLX thread's idle time

    def _spawn(self, argv: list[str], env: dict | None = None, tag: str = "") -> subprocess.Popen:
        log = open(self.log_dir / f"{self.name}{tag}.log", "wb")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, start_new_session=True)
        self.procs.append(p)
        return p

    def start(self) -> None:
        a, t0 = self.args, time.monotonic()
        # Unset shapes keep the platform plugin's defaults (what a user gets; they set the warm-up).
        shape = [f for flag, v in (("--max-num-batched-tokens", a.max_num_batched_tokens),
                                   ("--max-num-seqs", a.max_num_seqs), ("--max-model-len", a.max_model_len))
                 if v is not None for f in (flag, str(v))]
        if self.name in ("sidecar", "sidecar-sync", "worker-cls"):
            sport = free_port()
            self._spawn([str(PY), "-m", "sidecar", "serve", "--model", a.model, "--port", str(sport)], tag="-sidecar")
            self.sidecar_url = f"http://127.0.0.1:{sport}"
            wait_http(f"{self.sidecar_url}/healthz", 120)
            env = {"MLX_SIDECAR_URL": self.sidecar_url, "MLX_SIDECAR_PLATFORM": "1"}
            extra = []
            if self.name == "sidecar-sync":
                extra = ["--no-async-scheduling"]
            elif self.name == "worker-cls":
                env["MLX_SIDECAR_PLATFORM"] = "0"
                extra = ["--worker-cls", "sidecar.vllm.worker.MLXSidecarWorker", "--block-size", "16"]
            self._spawn([str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", self.paths["vllm_dir"],
                         "--served-model-name", "bench", "--port", str(self.port), "--kv-cache-memory-bytes",
                         str(a.kv_cache_memory_bytes), "--disable-log-stats", *shape, *extra], env=env)
        elif self.name == "vllm-mlx":
            self._spawn([str(VLLM_MLX), "serve", self.paths["weights"], "--port", str(self.port),
                         "--continuous-batching"])
        else:
            self._spawn([str(PY), "-m", "mlx_lm.server", "--model", self.paths["weights"], "--port", str(self.port)])
        wait_http(f"http://127.0.0.1:{self.port}/v1/models", a.ready_timeout, self.procs)
        self.ready_seconds = time.monotonic() - t0

    def cpu_seconds(self) -> float:
        return sum(tree_cpu_seconds(p.pid) for p in self.procs)

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()


def wait_http(url: str, timeout: float, procs: Sequence[subprocess.Popen] = ()) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a server exited before {url} answered (see its log)")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout}s")


def eos_token_ids(model_dir: str) -> list[int]:
    """The model's end-of-sequence ids (config.json, generation_config.json)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        f = Path(model_dir) / name
        if f.exists():
            v = json.loads(f.read_text()).get("eos_token_id")
            ids.update(v if isinstance(v, list) else [] if v is None else [v])
    return sorted(ids)


def extra_body(side: str, eos_ids: Sequence[int]) -> dict | None:
    """Request fields a side needs beyond what the client sends. mlx_lm.server answers the client's
    `"logprobs": null` with 400 "logprobs must be of type bool" (false means the same), and has no
    `ignore_eos`: a request whose first token is eos streams no text and the client counts it as
    failed, so eos is banned by `logit_bias` instead (every request then runs its full length)."""
    if side != "mlx-lm":
        return None
    return {"logprobs": False, "logit_bias": {str(t): -1e9 for t in eos_ids}}


def counted_tokens(side: str, result: dict, output_len: int) -> int:
    """Output tokens of a run: completed x output length (the client's re-tokenised count is wrong
    for a server that streams several tokens per chunk), except mlx_lm.server's, counted by its own
    usage figures (the client reads them from the stream): it has no `ignore_eos` to hold it to the
    length."""
    return result["total_output_tokens"] if side == "mlx-lm" else result["completed"] * output_len


def bench_once(side: Side, concurrency: int, args: argparse.Namespace, out_dir: Path) -> dict:
    name = f"{side.name}-c{concurrency}-{time.monotonic_ns()}.json"
    argv = [str(VLLM_PY), "-m", "bench.vllm_client", "--backend", "openai",
            "--base-url", f"http://127.0.0.1:{side.port}", "--endpoint", "/v1/completions", "--model", side.served,
            "--tokenizer", side.paths["vllm_dir"], "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--ignore-eos", "--temperature", "0", "--num-prompts",
            str(max(args.num_prompts, 2 * concurrency)), "--max-concurrency", str(concurrency), "--num-warmups",
            str(min(concurrency, 4)), "--save-result", "--result-dir", str(out_dir), "--result-filename", name,
            "--disable-tqdm", "--ready-check-timeout-sec", "0"]
    body = extra_body(side.name, eos_token_ids(side.paths["vllm_dir"]))
    if body:
        argv += ["--extra-body", json.dumps(body)]
    probe = IdleProbe(side.sidecar_url).start() if side.sidecar_url else None
    cpu0 = side.cpu_seconds()
    r = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    cpu = side.cpu_seconds() - cpu0
    idle = probe.stop() if probe else None
    if r.returncode != 0:
        raise RuntimeError(f"vllm bench serve against {side.name} failed:\n{r.stderr[-3000:]}")
    res = json.loads((out_dir / name).read_text())
    tokens = counted_tokens(side.name, res, args.output_len)
    return {"side": side.name, "concurrency": concurrency, "completed": res["completed"], "failed": res.get("failed", 0),
            "tok_s": tokens / res["duration"], "median_ttft_ms": res["median_ttft_ms"],
            "median_tpot_ms": res["median_tpot_ms"], "cpu_s_per_token": cpu / max(tokens, 1),
            **({"mlx_idle_share": idle[0], "steps": idle[1]} if idle else {})}


def summarise(runs: list[dict], sides: list[str], reference: str, concurrencies: list[int]) -> list[str]:
    lines = [f"{'conc':>4}  " + "  ".join(f"{s:>28}" for s in sides) + "   ratio tok/s to " + reference]
    table = {}
    for c in concurrencies:
        cells, ratios = [], []
        for s in sides:
            rs = [r for r in runs if r["side"] == s and r["concurrency"] == c]
            if not rs:
                cells.append(f"{'-':>28}")
                continue
            m = {k: statistics.median(r[k] for r in rs) for k in ("tok_s", "median_ttft_ms", "median_tpot_ms",
                                                                   "cpu_s_per_token")}
            table[(s, c)] = m
            cells.append(f"{m['tok_s']:7.0f} t/s {m['median_ttft_ms']:5.0f}/{m['median_tpot_ms']:4.1f} ms "
                         f"{m['cpu_s_per_token'] * 1e3:4.1f}cms")
        ref = table.get((reference, c))
        for s in sides:
            if ref and (s, c) in table and s != reference:
                ratios.append(f"{s} {table[(s, c)]['tok_s'] / ref['tok_s']:.2f}")
        lines.append(f"{c:>4}  " + "  ".join(cells) + "   " + ", ".join(ratios))
    lines.append("(cells: output tok/s, median TTFT / TPOT ms, CPU ms per output token over all the side's processes)")
    for s in sides:
        idle = {c: statistics.median(r["mlx_idle_share"] for r in rs) for c in concurrencies
                if (rs := [r for r in runs if r["side"] == s and r["concurrency"] == c and "mlx_idle_share" in r])}
        if idle:
            lines.append(f"{s}: the sidecar's MLX thread idle (waiting for a call) while steps ran: "
                         + ", ".join(f"{v:.1%} at c={c}" for c, v in idle.items()))
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="builtin:tiny")
    p.add_argument("--sides", default="sidecar,vllm-mlx,mlx-lm", help=f"a comma-separated subset of {','.join(SIDES)}")
    p.add_argument("--reference", default="vllm-mlx", help="the side the ratios divide by (if it ran)")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the plugin's")
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: the plugin's")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=256 << 20)
    p.add_argument("--ready-timeout", type=float, default=900)
    p.add_argument("--json", dest="json_path", default="bench-results/serve.json")
    args = p.parse_args(argv)
    available = {"sidecar": VLLM_PY.exists(), "sidecar-sync": VLLM_PY.exists(), "worker-cls": VLLM_PY.exists(),
                 "vllm-mlx": VLLM_MLX.exists(), "mlx-lm": PY.exists()}
    sides = [s for s in args.sides.split(",") if s]
    unknown = [s for s in sides if s not in SIDES]
    if unknown:
        p.error(f"unknown side {unknown[0]!r} (known: {', '.join(SIDES)})")
    for s in [s for s in sides if not available[s]]:
        print(f"skipping {s}: not installed ({'make install-vllm-mlx' if s == 'vllm-mlx' else 'make install'})")
    sides = [s for s in sides if available[s]]
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    vllm_dir = subprocess.run([str(PY), "-m", "sidecar", "model-dir", args.model, "--dest", str(work / "vllm-dir")],
                              check=True, capture_output=True, text=True, cwd=ROOT).stdout.strip()
    weights = subprocess.run([str(PY), "-m", "sidecar", "model-dir", args.model], check=True, capture_output=True,
                             text=True, cwd=ROOT).stdout.strip()
    paths = {"vllm_dir": vllm_dir, "weights": weights}
    runs: list[dict] = []
    ready: dict[str, float] = {}
    print(f"model {args.model}, sides {', '.join(sides)}, logs in {work}", flush=True)
    started: list[Side] = []
    try:
        for s in sides:  # each started alone (its start-up time is measured), then idle while the others run
            side = Side(s, args, paths, work)
            started.append(side)
            side.start()
            ready[s] = side.ready_seconds
            print(f"{s} ready in {side.ready_seconds:.0f} s", flush=True)
        for rnd in range(args.rounds):
            for c in concurrencies:
                for side in started:  # in turns: a busy spell on the machine hits every side alike
                    runs.append({**bench_once(side, c, args, work), "round": rnd})
                    r = runs[-1]
                    print(f"round {rnd} {side.name:>12} c={c:<3} {r['tok_s']:7.0f} tok/s  TTFT {r['median_ttft_ms']:6.1f} "
                          f"ms  TPOT {r['median_tpot_ms']:5.1f} ms  CPU {r['cpu_s_per_token'] * 1e3:5.2f} ms/token"
                          + (f"  MLX thread idle {r['mlx_idle_share']:.0%}" if "mlx_idle_share" in r else "")
                          + (f"  ({r['failed']} requests FAILED: see the side's log)" if r["failed"] else ""),
                          flush=True)
    finally:
        for side in started:
            side.stop()
    lines = summarise(runs, sides, args.reference, concurrencies)
    print("\n".join(lines))
    print("ready (s): " + ", ".join(f"{s} {v:.0f}" for s, v in ready.items()))
    out = Path(args.json_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "args": vars(args), "ready_seconds": ready, "runs": runs}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
