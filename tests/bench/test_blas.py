"""bench/blas.py: choosing the CPU BLAS, preloading it by restarting the command, and naming
the library libmlx's cblas_sgemm really binds to. No OpenBLAS needed: the restart is exercised
with the wheel's own BLAS file as the library to preload."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest

from bench import blas
from tests.server.serverproc import ROOT

CPU_LINUX = sys.platform == "linux" and not mx.metal.is_available()


def _bundled() -> str:
    libs = Path(mx.__file__).resolve().parents[1] / "mlx_cpu.libs"
    return str(next(libs.glob("libblas*.so*")))


def test_find_openblas_in_the_usual_places_first_name_first(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    (b / "openblas-pthread").mkdir(parents=True)
    a.mkdir()
    assert blas.find_openblas([str(a), str(b)]) is None  # a directory, not a library
    (b / "libopenblas.so.0").write_bytes(b"")
    assert blas.find_openblas([str(a), str(b)]) == str(b / "libopenblas.so.0")
    (b / "openblas-pthread" / "libopenblas.so.0").write_bytes(b"")  # Debian's pthread build wins
    assert blas.find_openblas([str(a), str(b)]) == str(b / "openblas-pthread" / "libopenblas.so.0")


def test_choose_by_mode_and_platform(tmp_path: Path) -> None:
    lib = tmp_path / "libopenblas.so.0"
    lib.write_bytes(b"")
    assert blas.choose("auto", platform="linux", found=str(lib)) == str(lib)
    assert blas.choose("auto", platform="linux", found=None) is None  # nothing installed: the bundled BLAS
    assert blas.choose("auto", platform="darwin", found=str(lib)) is None  # Accelerate / Metal
    assert blas.choose("bundled", platform="linux", found=str(lib)) is None
    assert blas.choose(" ", platform="linux", found=str(lib)) is None
    assert blas.choose(str(lib), platform="linux", found=None) == str(lib)
    with pytest.raises(ValueError, match=blas.ENV):
        blas.choose(str(tmp_path / "missing.so"), platform="linux", found=str(lib))


def test_preload_env_prepends_once_and_is_undone_for_a_process_without_mlx() -> None:
    env = blas.preload_env({"LD_PRELOAD": "/x/libjemalloc.so /lib/b.so", "PATH": "/bin"}, "/lib/b.so")
    assert env["LD_PRELOAD"] == "/lib/b.so /x/libjemalloc.so" and env["PATH"] == "/bin"
    assert env[blas.THREADS_ENV] == blas.DEFAULT_THREADS
    assert blas.preload_env({blas.THREADS_ENV: "2"}, "/lib/b.so")[blas.THREADS_ENV] == "2"  # the user's count
    back = blas.without_preload(env)
    assert back["LD_PRELOAD"] == "/x/libjemalloc.so" and "MLX_SIDECAR_BLAS_REEXEC" not in back
    assert "LD_PRELOAD" not in blas.without_preload(blas.preload_env({}, "/lib/b.so"))
    user = {"LD_PRELOAD": "/lib/mine.so"}  # a preload of the user's own, not ours: kept
    assert blas.without_preload(user) == user


def test_kind_and_label() -> None:
    assert blas.kind("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblasp-r0.3.21.so") == "OpenBLAS"
    assert blas.kind("/v/site-packages/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0") == "reference BLAS (bundled)"
    assert blas.kind("/usr/lib/libblas.so.3") == "reference BLAS"
    assert blas.kind(None, "darwin") == "Accelerate" and blas.kind(None, "linux") == "unknown"
    assert blas.label({"name": "OpenBLAS", "preloaded": True, "threads": 1}) == "OpenBLAS (preloaded, 1 thread)"
    assert blas.label({"name": "OpenBLAS", "preloaded": True, "threads": 2}) == "OpenBLAS (preloaded, 2 threads)"
    assert blas.label({"name": "reference BLAS (bundled)", "preloaded": False}) == "reference BLAS (bundled)"


@pytest.mark.skipif(not CPU_LINUX, reason="the bundled BLAS is the mlx[cpu] Linux wheel's")
def test_this_process_multiplies_with_the_bundled_blas() -> None:
    mx.eval(mx.ones((2, 3)) @ mx.ones((3, 2)))
    info = blas.describe()
    assert info["path"] == os.path.realpath(_bundled()) and info["name"] == "reference BLAS (bundled)", info
    assert info["path"] in blas.mapped()
    assert not any("numpy.libs" in p for p in blas.mapped())


_PROBE = textwrap.dedent("""
    import json, os, sys
    from bench import blas
    blas.reexec(sys.argv[1])
    print(json.dumps({"preload": os.environ.get("LD_PRELOAD"), "blas": blas.describe()}))
""")


@pytest.mark.skipif(not CPU_LINUX, reason="LD_PRELOAD and the bundled BLAS: Linux")
def test_reexec_restarts_once_with_the_library_bound() -> None:
    lib = _bundled()

    def probe(mode_env: str | None, default: str) -> list[dict]:
        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas.ENV, "MLX_SIDECAR_BLAS_REEXEC")}
        if mode_env is not None:
            env[blas.ENV] = mode_env
        r = subprocess.run([sys.executable, "-c", _PROBE, default], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return [json.loads(line) for line in r.stdout.splitlines()]

    (got,) = probe(lib, "bundled")  # one line: the first process was replaced, not run on
    assert got["preload"] == lib
    assert got["blas"]["preloaded"] and got["blas"]["path"] == os.path.realpath(lib)
    (plain,) = probe(None, "bundled")  # serve's default: nothing preloaded
    assert plain["preload"] is None and not plain["blas"]["preloaded"]


@pytest.mark.skipif(not CPU_LINUX, reason="LD_PRELOAD and the bundled BLAS: Linux")
def test_serve_never_swaps_the_blas(home: str) -> None:
    """Serving keeps the BLAS its process started with: `MLX_SIDECAR_BLAS` is the bench's alone, so
    `serve` neither restarts itself nor preloads the library it names (negative control: the bench
    test_reexec_restarts_once_with_the_library_bound does both for the same setting)."""
    import httpx

    from tests.server.serverproc import start_server

    lib = _bundled()
    with start_server(env={blas.ENV: lib, "LD_PRELOAD": None}) as s:
        assert httpx.get(f"{s.url}/healthz").status_code == 200
        environ = dict(kv.split("=", 1) for kv in Path(f"/proc/{s.proc.pid}/environ").read_text().split("\0") if "=" in kv)
        assert "LD_PRELOAD" not in environ and blas.THREADS_ENV not in environ
