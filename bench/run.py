"""The bench run: the sidecar (a real server subprocess, driven over HTTP by the reference
scheduler) against mlx-lm (in this process) on the same model, greedy, same prompts, eos ignored.

Scenarios (headline keys in the JSON): single_stream_ratio, batch32_ratio, rpc_overhead_ms_p50 /
rpc_overhead_ms_p99 (and per batch size), prefix_ttft_ratio, pool_size_ratio, sampling_mixed_ratio,
spec_repetitive_ratio / spec_random_ratio (n-gram speculation on vs off, spec.py),
embed_batch_ratio / embed_b1_ratio (embedding throughput, embed.py),
vllm_engine_ratio (vLLM's engine through the worker class / the reference scheduler, when .venv-vllm exists),
kv_store_ttft_ratio / kv_store_bandwidth_ratio / kv_store_decode_ratio / kv_store_bound_ratio (the disk KV tier),
plus throughput against concurrency for both sides (the PNG). Workload sizes: params.py.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from bench import blas, embed, kv_store, pool_sampling, report, scenarios, spec, vision, workloads
from bench.cpu import CpuMeter
from bench.params import BenchParams, from_cli
from bench.report import REQUIRED_KEYS, table
from bench.sides import MlxLmSide, ServerProcess, SidecarSide
from bench.vllm_engine import vllm_engine

__all__ = ["BenchParams", "REQUIRED_KEYS", "bench_cli", "run_bench"]


def machine_info() -> dict[str, Any]:
    import mlx.core as mx

    info: dict[str, Any] = {
        "platform": platform.platform(), "machine": platform.machine(), "python": platform.python_version(),
        "cpu_count": os.cpu_count(), "mlx_device": str(mx.default_device()),
        "metal": bool(mx.metal.is_available()),
        "cuda": bool(hasattr(mx, "cuda") and mx.cuda.is_available()),
    }
    try:
        info["memory_bytes"] = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        if sys.platform == "darwin":
            try:
                info["cpu"] = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True,
                                             text=True, timeout=5).stdout.strip()
            except (OSError, subprocess.SubprocessError):
                pass
    info["backend"] = "gpu" if info["metal"] or info["cuda"] else "cpu"
    # The BLAS MLX's CPU backend multiplies with: the mlx[cpu] wheel bundles netlib's reference
    # BLAS, whose matmul cost grows with every row; a preloaded one takes its place (README:
    # "Speculative decoding and the CPU BLAS"). numpy's own OpenBLAS (numpy.libs) is not MLX's.
    info["ld_preload"] = os.environ.get("LD_PRELOAD") or None
    info["blas"] = blas.describe()  # the library libmlx's cblas_sgemm binds to (bench/blas.py)
    try:
        with open("/proc/self/maps") as f:
            info["blas_libraries"] = sorted({ln.split()[-1] for ln in f if "blas" in ln.rsplit("/", 1)[-1]
                                             and "numpy.libs" not in ln})
    except OSError:
        pass
    return info


def _cpu_busy(seconds: float = 1.0) -> float | None:
    """Fraction of all cores busy over `seconds` (Linux /proc/stat), measured before anything starts."""

    def read() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + (v[4] if len(v) > 4 else 0)  # total, idle + iowait

    try:
        t0, i0 = read()
        time.sleep(seconds)
        t1, i1 = read()
    except (OSError, ValueError, IndexError):
        return None
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("mlx", "mlx-lm", "mlx-sidecar", "msgpack", "uvicorn", "starlette", "numpy"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "?"
    here = Path(__file__).resolve().parent
    try:
        out["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                                    cwd=here).stdout.strip()
        # Uncommitted changes under sidecar/ or bench/ at the start: the figures are for that tree, not the commit.
        dirty = subprocess.run(["git", "status", "--porcelain", "--", str(here.parent / "sidecar"), str(here)],
                               capture_output=True,
                               text=True, timeout=5, cwd=here).stdout.split("\n")
        out["git_dirty"] = " ".join(sorted(line[3:] for line in dirty if line.strip()))
    except (OSError, subprocess.SubprocessError):
        pass
    return out


class _LivePids:
    """The pids of the servers still running, read at each use."""

    def __init__(self, servers: list[ServerProcess]):
        self.servers = servers

    def __iter__(self):
        return iter([s.proc.pid for s in self.servers if s.proc is not None and s.proc.poll() is None])


STAGES = ("single_stream", "rpc batch 1", "batch", "sweep", "sampling", "prefix", "rpc overhead", "pool_size",
          "tiny single stream", "long context", "speculative", "embeddings", "vllm engine", "kv store", "images")


def run_bench(params: BenchParams, *, log: Callable[[str], None] | None = None,
              only: frozenset[str] | None = None) -> dict[str, Any]:
    """Run every scenario (or those in `only`, names from STAGES); returns the JSON document
    (flat figures at the top level)."""
    from sidecar.models import resolve_model

    t_start = time.perf_counter()
    log = log or scenarios.log_to_stderr(t_start)
    busy = _cpu_busy()
    code = versions()  # before the servers start: the code they run
    path = resolve_model(params.model, params.home)  # generate a built-in once, before the server looks
    servers: list[ServerProcess] = []
    sides: list[SidecarSide] = []
    log_dir = tempfile.TemporaryDirectory(prefix="sidecar-bench-")  # server logs, shown when one fails

    def make_side(extra: dict[str, Any], env: dict[str, str] | None = None) -> SidecarSide:
        server = ServerProcess(params.model, params.home, log_dir=log_dir.name, env=env, extra={
            "max_num_seqs": max(params.max_num_seqs, params.sampling_rows, max(params.sweep_concurrency)),
            "max_num_batched_tokens": params.max_num_batched_tokens, **extra})
        servers.append(server)
        t0 = time.perf_counter()
        server.start()
        side = SidecarSide(server, params.server_blocks, max_num_seqs=params.max_num_seqs,
                           max_num_batched_tokens=params.max_num_batched_tokens)
        side.bring_up_s["process_start"] = time.perf_counter() - t0 - sum(side.bring_up_s.values())
        sides.append(side)
        return side

    pairs: dict[tuple[str, str], tuple[SidecarSide, MlxLmSide]] = {}

    def pair_for(model: str, blocks: int, kv_dtype: str = "auto") -> tuple[SidecarSide, MlxLmSide]:
        """Both sides on another model (the main pair when it is the bench's own model); a
        kv_dtype other than auto gets its own server (mlx-lm's side is shared)."""
        if model == params.model and kv_dtype == "auto":
            return sidecar, mlx
        if (model, kv_dtype) not in pairs:
            model_path = resolve_model(model, params.home)
            server = ServerProcess(model, params.home, log_dir=log_dir.name, extra={
                "max_num_seqs": 4, "max_num_batched_tokens": params.max_num_batched_tokens,
                **({"kv_dtype": kv_dtype} if kv_dtype != "auto" else {})})
            servers.append(server)
            server.start()
            side = SidecarSide(server, blocks, max_num_seqs=4, max_num_batched_tokens=params.max_num_batched_tokens)
            sides.append(side)
            other = next((m for (name, _), (_, m) in pairs.items() if name == model), None)
            pairs[model, kv_dtype] = (side, other or (mlx if model == params.model else MlxLmSide(model_path)))
        return pairs[model, kv_dtype]

    try:
        log(f"profile {params.profile}: starting the sidecar server ({params.model}) and loading mlx-lm")
        sidecar = make_side({})
        mlx = MlxLmSide(path)
        b = scenarios.Bench(params, sidecar, mlx, log)
        b.results.update(server_start_s=sidecar.bring_up_s["process_start"],
                         server_bring_up_s=sum(sidecar.bring_up_s.values()), mlx_lm_load_s=mlx.load_s)
        log("warming up both sides")
        scenarios.warm_up(b)
        stages: list[tuple[str, Callable[[], None]]] = [
            ("single_stream", lambda: scenarios.single_stream(b)),
            ("rpc batch 1", lambda: scenarios.rpc_batch1_run(b)),
            ("batch", lambda: scenarios.batch32(b)),
            ("sweep", lambda: scenarios.sweep(b)),
            ("sampling", lambda: pool_sampling.sampling(b)),
            ("prefix", lambda: scenarios.prefix_ttft(b)),
            ("rpc overhead", lambda: scenarios.rpc_overhead(b)),
            ("pool_size", lambda: pool_sampling.pool_size(b, make_side)),
            ("tiny single stream", lambda: workloads.tiny_single_stream(b, pair_for)),
            ("long context", lambda: workloads.long_context(b, pair_for)),
            ("speculative", lambda: spec.speculative(b, make_side)),
            ("embeddings", lambda: embed.embeddings(b, make_side)),
            ("vllm engine", lambda: vllm_engine(b, make_side)),
            ("kv store", lambda: kv_store.kv_store(b, make_side)),
            ("images", lambda: vision.images(b, log_dir.name)),
        ]
        assert [n for n, _ in stages] == list(STAGES)
        stages = [(n, fn) for n, fn in stages if only is None or n in only]
        timings: dict[str, float] = {}
        meter = CpuMeter(_LivePids(servers))
        for name, fn in stages:
            log(f"{name} ...")
            t0 = time.perf_counter()
            fn()
            timings[name] = time.perf_counter() - t0
            other = meter.mark(name)
            if other is not None and other > 0.05:
                b.notes.append(f"{name}: other processes used {other:.0%} of the CPU during this stage "
                               "(the machine is shared): its figures are skewed")
        results = b.results
        notes = list(params.notes) + b.notes
        # (servers started with their own preload, the speculative stage's OpenBLAS pair, aside)
        server_blas = sorted({lib for pid in _LivePids([s for s in servers if not s.env]) for lib in blas.mapped(pid)})
        raw = b.raw
    finally:
        for side in sides:
            side.close()
        for server in servers:
            server.stop()
        log_dir.cleanup()

    elapsed = time.perf_counter() - t_start
    machine = machine_info()
    machine["cpu_busy_before_start"] = busy
    machine["server_blas_libraries"] = server_blas  # what the servers mapped: the same BLAS as this process
    bound = machine["blas"].get("path")
    if bound and server_blas and bound not in server_blas:
        notes.append(f"the servers did not map {bound}, the BLAS this process (mlx-lm) uses: ratios are unfair")
    if busy is not None and busy > 0.2:
        notes.append(f"{busy:.0%} of the CPU was busy with something else in the second before the bench "
                     "started: the figures are noisier than usual")
    doc: dict[str, Any] = {
        **{k: results[k] for k in REQUIRED_KEYS if k in results},
        **{k: v for k, v in results.items() if k not in REQUIRED_KEYS},
        "elapsed_s": elapsed,
        "profile": params.profile,
        "model": params.model,
        "model_path": str(path),
        "backend_label": f"MLX {machine['backend'].upper()} backend",
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mlx_version": code.get("mlx"),
        "mlx_lm_version": code.get("mlx-lm"),
        "versions": code,
        "machine": machine,
        "params": params.to_json(),
        "stage_seconds": timings,
        "stage_foreign_cpu": meter.stages,
        "sweep": raw.get("sweep"),
        "long_ctx_curve": raw.get("long_ctx_curve"),
        "raw": {k: v for k, v in raw.items() if k not in ("sweep", "long_ctx_curve")},
        "notes": notes,
    }
    return doc


def render(doc: dict[str, Any]) -> str:
    head = (f"mlx-sidecar bench ({doc['profile']}) - {doc['model']} - {doc['backend_label']} - "
            f"{doc['machine'].get('cpu', doc['machine']['machine'])}, {doc['machine']['cpu_count']} cores - "
            f"mlx {doc['mlx_version']}, mlx-lm {doc['mlx_lm_version']}, sidecar {doc['versions'].get('git', '?')}"
            + (" (+ uncommitted changes)" if doc["versions"].get("git_dirty") else "")
            + (f" - BLAS {blas.label(doc['machine']['blas'])}" if doc["machine"].get("blas") else ""))
    parts = [head, "", table(doc)]
    if doc.get("sweep"):
        parts += ["", "throughput against concurrency (generated tokens/s, prefill included):",
                  report.sweep_table(doc["sweep"])]
    if doc.get("long_ctx_curve"):
        parts += ["", f"single-stream decode against context ({doc.get('long_model')}, tokens/s, prefill excluded):",
                  report.curve_table(doc["long_ctx_curve"])]
    if doc.get("notes"):
        parts += ["", *("note: " + n for n in doc["notes"])]
    parts += ["", f"elapsed {doc['elapsed_s']:.0f}s"]
    return "\n".join(parts)


def _only(arg: str | None) -> frozenset[str] | None:
    """`--only "tiny single stream,long context"`: a comma-separated subset of STAGES."""
    if not arg:
        return None
    names = frozenset(n.strip() for n in arg.split(",") if n.strip())
    unknown = sorted(names - set(STAGES))
    if unknown:
        raise ValueError(f"--only: unknown stage(s) {', '.join(map(repr, unknown))}; stages: {', '.join(STAGES)}")
    return names


def bench_cli(args: argparse.Namespace) -> int:
    try:
        params = from_cli(bool(getattr(args, "quick", False)), model=args.model, home=getattr(args, "home", None))
        only = _only(getattr(args, "only", None))
    except ValueError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    try:
        doc = run_bench(params, only=only)
    except KeyboardInterrupt:
        print("bench: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - one line for the user, the servers are already stopped
        import traceback

        traceback.print_exc()
        print(f"bench: failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    json_path = report.write_json(args.json_path, doc)
    title = f"{doc['model']} - {doc['backend_label']} - {doc['machine'].get('cpu', '')} ({doc['profile']})"
    png = report.plot(args.plot_path, doc["sweep"], title, doc.get("long_ctx_curve")) if doc.get("sweep") else None
    print(render(doc))
    print(f"json: {json_path}")
    print(f"plot: {png}" if png else "plot: skipped (pip install matplotlib, or `pip install -e '.[bench]'`)")
    return 0
