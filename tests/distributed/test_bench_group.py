"""`python -m bench --scale-out` (bench/group.py) on real servers: a 1-rank run and a
TP=2 group of the same model, the group's tokens checked against the 1-rank run."""

from __future__ import annotations

import pytest

from bench.group import CONFIGS, render, run_group_bench

pytestmark = pytest.mark.distributed


def test_scale_out_bench_runs_both_sides_and_checks_tokens(home: str) -> None:
    doc = run_group_bench(home, quick=True, configs=CONFIGS[:2], log=lambda s: None)
    single, group = doc["rows"]
    assert (single["label"], group["label"]) == ("1 rank", "TP=2")
    assert single["tokens_equal"] and group["tokens_equal"]  # the group reproduced the 1-rank tokens
    assert group["tokens_per_s"] > 0 and group["steps"] >= doc["workload"]["new_tokens"]
    assert single["collective_ms_per_step"] == 0 < group["collective_ms_per_step"] < group["step_ms"]
    out = render(doc)
    assert "not speed-up" in out and "TP=2" in out and "DIFFER" not in out
