"""The warm-up heartbeat logs while a call runs, says the shape, and stops when it returns."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest

from sidecar.vllm.progress import heartbeat, log, warm_up_shape


@pytest.fixture
def caplog(caplog: pytest.LogCaptureFixture):
    """On vLLM's logger (which vLLM keeps from propagating to the root, where caplog listens)."""
    log.addHandler(caplog.handler)
    level = log.level
    log.setLevel(logging.INFO)
    yield caplog
    log.setLevel(level)
    log.removeHandler(caplog.handler)


def test_heartbeat_logs_while_the_call_runs_and_stops_after(caplog: pytest.LogCaptureFixture) -> None:
    with heartbeat("warming up", every=0.05):
        time.sleep(0.3)
    beats = [r.getMessage() for r in caplog.records if "still warming up" in r.getMessage()]
    assert len(beats) >= 2
    assert "done warming up" in caplog.records[-1].getMessage()
    n = len(caplog.records)
    time.sleep(0.15)
    assert len(caplog.records) == n  # the thread ended with the call
    caplog.clear()
    with heartbeat("quick", every=10):
        pass
    assert not [r for r in caplog.records if "still" in r.getMessage()]  # negative control: nothing for a quick call


def test_the_shape_names_vllms_flags() -> None:
    text = warm_up_shape(SimpleNamespace(max_num_batched_tokens=512, max_num_seqs=8))
    assert "512-token prefill" in text and "--max-num-batched-tokens" in text and "8-sequence" in text
