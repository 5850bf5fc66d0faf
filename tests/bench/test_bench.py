"""Smoke test of the bench (`python -m bench`): the whole harness on builtin:tiny with tiny sizes.

Not a timing test: it checks that every scenario runs (a real server subprocess and mlx-lm), that
the JSON carries every headline key with a finite value, and that the table and the plot are made.
"""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

from bench.params import PROFILE_ENV, from_cli, quick, tiny
from bench.report import GOALS, REQUIRED_KEYS, table
from bench.__main__ import main


@pytest.mark.bench
def test_bench_tiny_end_to_end(home: str, tmp_path, monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv(PROFILE_ENV, "tiny")
    json_path, png_path = tmp_path / "out" / "bench.json", tmp_path / "out" / "throughput.png"
    rc = main(["--model", "builtin:tiny", "--home", home, "--json", str(json_path), "--plot", str(png_path)])
    out = capsys.readouterr().out
    assert rc == 0, out

    doc = json.loads(json_path.read_text())
    bad = {k: doc.get(k) for k in REQUIRED_KEYS
           if not isinstance(doc.get(k), (int, float)) or not math.isfinite(doc[k])}
    assert not bad, f"missing or non-finite: {bad}"
    assert doc["profile"] == "tiny" and doc["model"] == "builtin:tiny"
    assert doc["sampling_mixed_ahead_hits"] > 0 and doc["sampling_greedy_ahead_hits"] > 0
    assert doc["mlx_version"] and doc["mlx_lm_version"] and doc["machine"]["cpu_count"]
    # The BLAS, named in the head; the servers mapped the one this process (mlx-lm) multiplies with.
    blas = doc["machine"]["blas"]
    assert f"BLAS {blas['name']}" in out.splitlines()[0]
    assert blas["path"] is None or blas["path"] in doc["machine"]["server_blas_libraries"], doc["machine"]
    assert doc["single_stream_tokens_match"] == 1.0  # same model, greedy: the same tokens on both sides
    assert doc["prefix_cached_tokens"] >= doc["prefix_len"] - 16  # the warm request really hit the cache
    sweep = doc["sweep"]
    assert len(sweep["sidecar_tok_s"]) == len(sweep["mlx_lm_tok_s"]) == len(sweep["concurrency"])
    assert all(x > 0 for x in sweep["sidecar_tok_s"] + sweep["mlx_lm_tok_s"])

    # The table: a header and one row per scenario, each with a verdict column.
    for word in ("scenario", "sidecar", "mlx-lm", "ratio", "goal", "result"):
        assert word in out
    # The `_bundled` speculative figures exist only where an OpenBLAS was there to compare with.
    from bench.spec import _fast_blas_env

    assert doc["spec_openblas_pair"] == (_fast_blas_env() is not None)
    _check_spec_figures(doc, out)
    # The image goals are measured only with the vision extra (make test-vision installs it).
    vision = importlib.util.find_spec("mlx_vlm") is not None
    for goal in GOALS:
        optional = goal.key.startswith("long_ctx_") or goal.key.endswith("_bundled")
        assert goal.key in doc or optional or (goal.key.startswith("image_") and not vision), goal.key
    assert vision == any(k.startswith("image_") for k in doc)
    assert vision or "images: skipped (the vision extra is not installed" in out
    # Goals whose figure this profile does not measure (the 4k/16k contexts) show n/a.
    assert out.count("PASS") + out.count("FAIL") == sum(1 for g in GOALS if g.op and doc.get(g.key) is not None)
    assert doc["tiny_single_stream_tokens_match"] == 1.0
    assert doc["embed_max_abs_diff"] < 1e-4  # both sides embed the same prompts alike
    assert doc["tiny_single_stream_pipelined_tokens_match"] == doc["tiny_single_stream_pipelined_2conn_tokens_match"] == 1.0
    assert doc["tiny_single_stream_steps_tokens_match"] == 1.0  # several decode steps a call: the same tokens
    curve = doc["long_ctx_curve"]
    assert curve["context"] == [64, 200]  # the tiny profile's contexts
    for n in curve["context"]:
        assert doc[f"long_ctx_{n}_tokens_match"] == 1.0  # after the cached context, the same tokens
        assert math.isfinite(doc[f"long_ctx_{n}_ratio"]) and doc[f"long_ctx_{n}_ratio"] > 0
    assert doc["long_ctx_200_kv8_tokens_match"] == 1.0  # --kv-dtype 8bit: mlx-lm's 8-bit-KV tokens
    assert doc["long_ctx_200_kv8_ratio"] > 0 and doc["long_ctx_200_kv8_vs_fp_sidecar"] > 0
    assert "decode against context" in out
    assert f"json: {json_path}" in out
    pytest.importorskip("matplotlib")
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


BUNDLED = [g for g in GOALS if g.key.endswith("_bundled")]


def _check_spec_figures(doc: dict, out: str) -> None:
    """The headline speculative figures always; the `_bundled` ones exactly when the OpenBLAS pair
    ran, and otherwise shown as not measured (n/a) in the table."""
    for case in ("repetitive", "random"):
        assert math.isfinite(doc[f"spec_{case}_ratio"]), case
    assert BUNDLED
    for g in BUNDLED:
        row = next(line for line in out.splitlines() if line.startswith(g.title))
        if doc["spec_openblas_pair"]:
            assert math.isfinite(doc[g.key]) and "n/a" not in row and "not measured" not in row, (g.key, row)
        else:
            assert g.key not in doc and "not measured" in row and "n/a" in row and "nan" not in row, (g.key, row)
    assert doc["spec_blas_short"] == ("OpenBLAS" if doc["spec_openblas_pair"] else doc["machine"]["blas"]["name"])


@pytest.mark.bench
def test_bench_speculative_in_the_other_state_of_the_machine(home: str, tmp_path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture) -> None:
    """Both states of the machine, whatever this one has installed: test_bench_tiny_end_to_end runs
    the one it is in (an OpenBLAS installed or not), this the other. The pair's servers preload a
    real BLAS library (the wheel's own where no OpenBLAS is installed: the code path is the same)."""
    from bench import blas, spec

    pair = spec._fast_blas_env() is None
    lib = blas.find_openblas() or blas.bound_library()
    if pair and lib is None:
        pytest.skip("no BLAS library file to preload (macOS: Accelerate)")
    monkeypatch.setattr(spec, "_fast_blas_env", lambda: blas.preload_env({}, lib) if pair else None)
    monkeypatch.setenv(PROFILE_ENV, "tiny")
    json_path = tmp_path / "bench.json"
    rc = main(["--model", "builtin:tiny", "--home", home, "--only", "speculative",
               "--json", str(json_path), "--plot", str(tmp_path / "p.png")])
    out = capsys.readouterr().out
    assert rc == 0, out
    doc = json.loads(json_path.read_text())
    assert doc["spec_openblas_pair"] is pair
    _check_spec_figures(doc, out)


def test_presets_and_table_without_results(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PROFILE_ENV, raising=False)
    assert from_cli(True, model="m").profile == "quick" and from_cli(False).profile == "full"
    monkeypatch.setenv(PROFILE_ENV, "nope")
    with pytest.raises(ValueError, match=PROFILE_ENV):
        from_cli(False)
    assert quick().model == "builtin:small" and tiny().model == "builtin:tiny"
    text = table({})  # every figure missing: shown as n/a, never a crash
    assert text.count("n/a") >= len([g for g in GOALS if g.op])


def test_machine_info_names_the_blas_mlx_multiplies_with(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    import mlx.core as mx

    from bench.run import machine_info

    mx.eval(mx.ones((2, 3)) @ mx.ones((3, 2)))
    monkeypatch.setenv("LD_PRELOAD", "/nonexistent/libopenblas.so.0")
    info = machine_info()
    assert info["ld_preload"] == "/nonexistent/libopenblas.so.0"
    if sys.platform == "linux" and not mx.metal.is_available():
        assert any("mlx" in p and "blas" in p for p in info["blas_libraries"]), info["blas_libraries"]
        assert not any("numpy.libs" in p for p in info["blas_libraries"])  # numpy's own BLAS is not MLX's
    monkeypatch.delenv("LD_PRELOAD")
    assert machine_info()["ld_preload"] is None


def test_only_names_a_subset_of_the_stages_and_refuses_unknown_ones():
    from bench.run import STAGES, _only

    assert _only(None) is None and _only("") is None
    assert _only("tiny single stream, long context") == frozenset({"tiny single stream", "long context"})
    assert set(STAGES) >= {"tiny single stream", "long context", "speculative"}
    with pytest.raises(ValueError, match="'nope'"):
        _only("long context,nope")
