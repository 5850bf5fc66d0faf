"""Pooling without vLLM: the reference scheduler drives pooling requests (chunked, preempted,
mixed with generation) and `mlx-sidecar embed` prints mlx-lm's own pooled hidden states from a
real server."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import numpy as np
import pytest

from sidecar.client.remote import RemoteError, RemoteWorker
from sidecar.models import resolve_model
from sidecar.scheduler import Request, Scheduler, run
from sidecar.scheduler.generate import load_tokenizer
from tests.conftest import mlx_lm_greedy
from tests.engine.test_pooling import EMBED, hidden, normalise, prompt
from tests.server.serverproc import start_server


def test_reference_scheduler_pools_through_chunks_and_preemption(make_worker, oracle_model) -> None:
    w = make_worker(EMBED, num_blocks=7)
    sched = Scheduler(num_blocks=7, block_size=w.config.block_size, max_num_batched_tokens=7, max_num_seqs=8)
    model = oracle_model(EMBED)
    gens = {f"g{i}": prompt(20, seed=i) for i in range(2)}
    pools = {f"m{i}": (prompt(50 + i, seed=10 + i), kind) for i, kind in enumerate(["MEAN", "LAST", "CLS"])}
    for (rid, p), (pid, (pp, kind)) in zip(gens.items(), pools.items()):
        sched.add_request(Request(rid, p, {"temperature": 0.0}, max_tokens=40))
        sched.add_request(Request(pid, pp, {}, max_tokens=1, pooling_params={"pooling_type": kind}))
    sched.add_request(Request("m2", pools["m2"][0], {}, max_tokens=1, pooling_params={"pooling_type": "CLS"}))
    done = run(sched, lambda so: w.execute_model(so).to_wire())
    assert sum(r.num_preemptions for r in done.values()) > 0  # the pool is too small for all at once
    for rid, (p, kind) in pools.items():
        h = hidden(model, p)
        want = normalise({"MEAN": h.mean(axis=0), "LAST": h[-1], "CLS": h[0]}[kind])
        np.testing.assert_allclose(done[rid].pooled, want, atol=1e-5, err_msg=rid)
        assert done[rid].output_token_ids == [] and done[rid].finish_reason == "stop"
    for rid, p in gens.items():
        assert done[rid].output_token_ids == mlx_lm_greedy(model, p, 40)[0]
    assert not w.runner.requests  # every request dropped by the last step


def test_embed_cli_and_remote_worker_against_a_real_server(home: str, oracle_model) -> None:
    texts = ["The lighthouse keeper rose before the sun.", "A river does not hurry"]
    tok = load_tokenizer(str(resolve_model(EMBED, home)))
    model = oracle_model(EMBED)
    with start_server("--model", EMBED, "--max-num-batched-tokens", "64", "--max-num-seqs", "4") as s:
        out = subprocess.run([sys.executable, "-m", "sidecar", "embed", "--url", s.url, *texts],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        lines = [json.loads(line) for line in out.stdout.splitlines()]
        assert [x["text"] for x in lines] == texts
        for x in lines:
            want = normalise(hidden(model, tok.encode(x["text"]).ids)[-1])
            np.testing.assert_allclose(x["embedding"], want, atol=1e-5)
        out = subprocess.run([sys.executable, "-m", "sidecar", "embed", "--url", s.url, "--dimensions", "8",
                              "--pooling-type", "MEAN", texts[0]], capture_output=True, text=True, timeout=120)
        got = json.loads(out.stdout)["embedding"]
        np.testing.assert_allclose(got, normalise(hidden(model, tok.encode(texts[0]).ids).mean(axis=0)[:8]), atol=1e-5)
        # Over the wire: a bad request is a 400 naming the field, and nothing is registered.
        remote = RemoteWorker(s.url)
        bad = {"scheduled_new_reqs": [{"req_id": "x", "prompt_token_ids": [5, 6], "block_ids": [[0]],
                                       "num_computed_tokens": 0, "pooling_params": {"dimensions": 1000}}],
               "num_scheduled_tokens": {"x": 2}, "total_num_scheduled_tokens": 2}
        with pytest.raises(RemoteError) as e:
            remote.call("execute_model", scheduler_output=bad)
        assert e.value.status == 400 and e.value.field == "scheduled_new_reqs[0].pooling_params.dimensions"
        bad["scheduled_new_reqs"][0]["pooling_params"] = {}
        res = remote.call("execute_model", scheduler_output=bad)  # now valid: pooled at once
        assert len(res["pooler_output"][0]) == 64 and res["sampled_token_ids"] == [[]]
        remote.close()
        metrics = urllib.request.urlopen(s.url + "/metrics").read().decode()
        assert "mlx_worker_pooling_requests_total 4.0" in metrics
