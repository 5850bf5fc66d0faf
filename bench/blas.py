"""The BLAS MLX's CPU backend multiplies with, and an optimised one in its place on Linux.

The mlx[cpu] Linux wheel links netlib's reference BLAS (mlx_cpu.libs/libblas-*.so), whose matmul
cost grows linearly with the rows: verifying k speculative tokens costs k + 1 decode steps there
(docs/performance.md). An OpenBLAS preloaded (LD_PRELOAD) is searched
before the wheel's own libraries, so libmlx's `cblas_sgemm` binds to it. The dynamic loader reads
LD_PRELOAD only when a process starts: `reexec` restarts the command once with it set, and every
process it starts (the bench's servers) inherits it, so both sides of a comparison share it.

MLX_SIDECAR_BLAS chooses: `auto` (an OpenBLAS installed on the machine, else the bundled BLAS),
`bundled` (never preload, the default), or the path of a BLAS library; read by the bench
(`python -m bench`) only (a measurement aid: serving never swaps the BLAS). Elsewhere (macOS: Accelerate, Metal)
nothing is preloaded.
"""

from __future__ import annotations

import ctypes
import os
import sys
import sysconfig
from pathlib import Path
from typing import Any, Mapping, Sequence

ENV = "MLX_SIDECAR_BLAS"
THREADS_ENV = "OPENBLAS_NUM_THREADS"
_MARK = "MLX_SIDECAR_BLAS_REEXEC"  # set in the restarted process: never restart twice
MODES = ("auto", "bundled")
# Debian/Ubuntu (libopenblas0-pthread / -openmp / -serial), Fedora/RHEL (openblas), source installs.
_NAMES = ("openblas-pthread/libopenblas.so.0", "libopenblas.so.0", "openblas-openmp/libopenblas.so.0",
          "openblas-serial/libopenblas.so.0", "libopenblasp.so.0", "libopenblas.so")
# One thread: the bench's client process and the server share the cores (measured: README).
DEFAULT_THREADS = "1"


def lib_dirs() -> list[str]:
    arch = sysconfig.get_config_var("MULTIARCH") or ""
    dirs = [f"/usr/lib/{arch}"] if arch else []
    return dirs + ["/usr/lib64", "/usr/lib", "/usr/local/lib"]


def find_openblas(dirs: Sequence[str] | None = None) -> str | None:
    """The first OpenBLAS shared library in the usual places, or None."""
    for d in lib_dirs() if dirs is None else dirs:
        for name in _NAMES:
            p = Path(d) / name
            if p.is_file():
                return str(p)
    return None


def choose(mode: str, *, platform: str, found: str | None) -> str | None:
    """The library to preload for MLX_SIDECAR_BLAS=`mode` (None: the bundled BLAS). A path must
    exist (ValueError naming the variable otherwise)."""
    mode = mode.strip()
    if mode in ("", "bundled"):
        return None
    if mode == "auto":
        return found if platform.startswith("linux") else None
    if not Path(mode).is_file():
        raise ValueError(f"{ENV}={mode!r}: not {' or '.join(MODES)} and no such library file")
    return mode


def preload_env(env: Mapping[str, str], lib: str) -> dict[str, str]:
    """`env` with `lib` first in LD_PRELOAD (kept once), a thread count unless one is set, and the
    restart mark."""
    out = dict(env)
    rest = [p for p in out.get("LD_PRELOAD", "").replace(":", " ").split() if p != lib]
    out["LD_PRELOAD"] = " ".join([lib, *rest])
    out.setdefault(THREADS_ENV, DEFAULT_THREADS)
    out[_MARK] = "1"
    return out


def without_preload(env: Mapping[str, str]) -> dict[str, str]:
    """`env` for a process that runs no MLX (the vLLM engine driver): the BLAS preload removed."""
    out = dict(env)
    lib = out.get("LD_PRELOAD")
    if out.pop(_MARK, None) and lib:
        rest = lib.split()[1:]
        if rest:
            out["LD_PRELOAD"] = " ".join(rest)
        else:
            out.pop("LD_PRELOAD")
    return out


def reexec(default_mode: str) -> None:
    """Restart this command with the chosen BLAS preloaded, when there is one and it is not yet
    (returns otherwise). Call before any work: the process image is replaced."""
    env = os.environ
    if env.get(_MARK):
        return
    try:
        lib = choose(env.get(ENV, default_mode), platform=sys.platform, found=find_openblas())
    except ValueError as e:
        print(f"mlx-sidecar: {e}; using the bundled BLAS", file=sys.stderr)
        return
    if lib is None or lib in env.get("LD_PRELOAD", "").replace(":", " ").split():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], preload_env(env, lib))


def mapped(pid: int | str = "self") -> list[str]:
    """The BLAS libraries a process has mapped (Linux /proc; numpy's own, which MLX never calls,
    left out)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return sorted({os.path.realpath(ln.split()[-1]) for ln in f if "blas" in ln.rsplit("/", 1)[-1]
                           and "numpy.libs" not in ln and "/" in ln})
    except OSError:
        return []


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def _library_of(fn: Any) -> str | None:
    info = _DlInfo()
    libc = ctypes.CDLL(None)
    if not libc.dladdr(ctypes.cast(fn, ctypes.c_void_p), ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.path.realpath(info.dli_fname.decode())


def bound_library(symbol: str = "cblas_sgemm") -> str | None:
    """The file whose `symbol` libmlx calls, resolved as the loader does: the global scope first
    (the executable, LD_PRELOAD), then libmlx's own dependencies. None where not found (macOS)."""
    import mlx.core as mx

    for handle in (None, str(Path(mx.__file__).resolve().parent / "lib" / "libmlx.so")):
        if handle is not None and not Path(handle).is_file():
            continue
        try:
            return _library_of(getattr(ctypes.CDLL(handle), symbol))
        except (AttributeError, OSError):
            continue
    return None


def kind(path: str | None, platform: str = sys.platform) -> str:
    """A short name for a BLAS library file."""
    if path is None:
        return "Accelerate" if platform == "darwin" else "unknown"
    base = os.path.basename(path).lower()
    if "openblas" in base:
        return "OpenBLAS"
    if "mlx_cpu.libs" in path and base.startswith("libblas"):
        return "reference BLAS (bundled)"
    for key, name in (("mkl", "MKL"), ("blis", "BLIS"), ("libblas", "reference BLAS")):
        if key in base:
            return name
    return base


def describe() -> dict[str, Any]:
    """What the bench records: the library bound, its short name, whether preloaded, threads."""
    path = bound_library()
    out: dict[str, Any] = {"name": kind(path), "path": path, "preloaded": bool(os.environ.get(_MARK)) or (
        path is not None and any(os.path.realpath(p) == path for p in os.environ.get("LD_PRELOAD", "").split()))}
    if path is not None and "openblas" in os.path.basename(path).lower():
        try:
            out["threads"] = int(ctypes.CDLL(path).openblas_get_num_threads())
        except (AttributeError, OSError):
            pass
    return out


def label(info: Mapping[str, Any]) -> str:
    """`OpenBLAS (preloaded, 1 thread)` for the bench table's head."""
    extra = [x for x in ("preloaded" if info.get("preloaded") else "",
                         f"{info['threads']} thread{'s' * (info['threads'] != 1)}" if info.get("threads") else "") if x]
    return info.get("name", "unknown") + (f" ({', '.join(extra)})" if extra else "")
