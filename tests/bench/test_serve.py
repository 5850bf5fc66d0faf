"""bench/serve.py's pure parts: the side-by-side table and its ratios, CPU time of a process tree,
and an unknown side refused by name (the servers themselves run in `make bench-serve`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from bench.serve import PY, counted_tokens, eos_token_ids, extra_body, free_port, main, summarise, tree_cpu_seconds, wait_http


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


def test_the_sidecars_idle_share_is_summarised_where_it_was_measured() -> None:
    runs = [{**run("sidecar", 8, 900), "mlx_idle_share": share} for share in (0.02, 0.04, 0.09)]
    lines = summarise([*runs, run("vllm-mlx", 8, 800)], ["sidecar", "vllm-mlx"], "vllm-mlx", [8])
    assert [line for line in lines if "idle" in line] == [
        "sidecar: the sidecar's MLX thread idle (waiting for a call) while steps ran: 4.0% at c=8"]  # the median


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


@pytest.mark.bench  # a real mlx_lm.server: make test-bench
def test_mlx_lm_server_takes_the_clients_request_with_the_extra_body(tmp_path) -> None:
    weights = subprocess.run([str(PY), "-m", "sidecar", "model-dir", "builtin:tiny"], check=True, capture_output=True,
                             text=True).stdout.strip()
    port = free_port()
    server = subprocess.Popen([str(PY), "-m", "mlx_lm.server", "--model", weights, "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # The fields `vllm bench serve` sends to /v1/completions (its openai backend), greedy, ignore_eos.
    sent = {"model": weights, "prompt": "The lighthouse keeper", "repetition_penalty": 1.0, "max_tokens": 4,
            "logprobs": None, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
            "temperature": 0}

    def post(body: dict) -> tuple[int, str]:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    try:
        wait_http(f"http://127.0.0.1:{port}/v1/models", 120, [server])
        status, text = post(sent)
        assert status == 400 and "logprobs" in text  # the client's own body: what left the column empty
        # The client merges --extra-body last. eos banned: a prompt whose greedy first token is eos
        # would otherwise stream no text (the client's "failed") and stop at 0 tokens.
        eos = eos_token_ids(weights)
        assert eos
        status, text = post({**sent, "logit_bias": {str(t): 1e9 for t in eos}, "logprobs": False})
        assert status == 200 and '"finish_reason": "stop"' in text and '"completion_tokens": 4' not in text  # control
        status, text = post({**sent, **extra_body("mlx-lm", eos)})
        assert status == 200 and '"completion_tokens": 4' in text
        assert extra_body("sidecar", eos) is None
    finally:
        server.terminate()
        server.wait(30)


def test_tokens_are_counted_by_the_server_only_where_it_ignores_ignore_eos() -> None:
    result = {"completed": 8, "total_output_tokens": 200}  # some requests stopped at eos
    assert counted_tokens("mlx-lm", result, 32) == 200
    assert counted_tokens("vllm-mlx", result, 32) == counted_tokens("sidecar", result, 32) == 256
