"""bench/serve.py's pure parts: the side-by-side table and its ratios, CPU time of a process tree,
and an unknown side refused by name (the servers themselves run in `make bench-serve`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench.serve import main, summarise, tree_cpu_seconds


def run(side: str, c: int, tok_s: float) -> dict:
    return {"side": side, "concurrency": c, "tok_s": tok_s, "median_ttft_ms": 10.0, "median_tpot_ms": 2.0,
            "cpu_s_per_token": 0.003}


def test_the_table_has_every_side_and_the_ratio_to_the_reference() -> None:
    runs = [run("sidecar", 1, 300), run("sidecar", 1, 500), run("vllm-mlx", 1, 400), run("sidecar", 8, 900)]
    lines = summarise(runs, ["sidecar", "vllm-mlx"], "vllm-mlx", [1, 8])
    row1 = next(line for line in lines if line.strip().startswith("1 "))
    assert "sidecar 1.00" in row1  # median of 300 and 500 over 400
    row8 = next(line for line in lines if line.strip().startswith("8 "))
    assert " - " in row8 and "sidecar" not in row8.split("   ")[-1]  # no reference at 8: no ratio, not a 0 or a crash


def test_cpu_seconds_of_a_process_tree_count_its_children() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.3: pass\ntime.sleep(30)"])
    try:
        deadline = 50
        while deadline and tree_cpu_seconds(child.pid) < 0.25:
            deadline -= 1
            subprocess.run(["sleep", "0.1"])
        assert tree_cpu_seconds(os.getpid()) >= tree_cpu_seconds(child.pid) >= 0.25  # the child is in our tree
    finally:
        child.kill()
        child.wait()


def test_an_unknown_side_is_refused_by_name(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["--sides", "sidecar,nope"])
    assert "unknown side 'nope'" in capsys.readouterr().err
