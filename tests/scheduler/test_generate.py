from __future__ import annotations

import signal
import subprocess
import sys

from sidecar.models import resolve_model
from sidecar.scheduler.generate import load_tokenizer
from tests.conftest import mlx_lm_greedy
from tests.server.serverproc import free_port, start_server
from tests.server.prom import samples, scrape


def _generate(*argv: str) -> str:
    out = subprocess.run([sys.executable, "-m", "sidecar", "generate", *argv], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_generate_cli_streams_mlx_lm_greedy_text(home: str, oracle_model) -> None:
    """`mlx-sidecar generate` against a fresh server (it drives the lifecycle itself) prints the
    text of exactly mlx-lm's greedy tokens; a sampled run differs, pipelined runs and runs of
    several decode steps a call do not."""
    tok = load_tokenizer(str(resolve_model("builtin:tiny", home)))
    prompt = "hello"
    want_ids, _ = mlx_lm_greedy(oracle_model("builtin:tiny"), tok.encode(prompt).ids, 12)
    if 1 in want_ids:  # eos (id 1 in the built-in tokenizer) stops the scheduler
        want_ids = want_ids[: want_ids.index(1) + 1]
    want = tok.decode(want_ids, skip_special_tokens=True)
    with start_server("--max-num-batched-tokens", "64", "--max-num-seqs", "4") as s:  # a quick profile run
        flags = ["--url", s.url, "--max-tokens", "12", "--no-chat", prompt]
        out = _generate(*flags)
        assert out == want + "\n"
        assert want.strip()
        assert _generate(*flags, "--temperature", "1.0", "--seed", "5") != out
        for conns in ("1", "2"):  # two steps in flight: the same greedy text
            assert _generate(*flags, "--pipeline", conns) == out
        def counts() -> tuple[float, float]:
            m = samples(scrape(s.url))
            return m[("mlx_worker_steps_total", ())], m[("mlx_worker_more_decode_steps_total", ())]

        calls, more = counts()
        assert more == 0  # nothing above asked for several decode steps a call
        assert _generate(*flags, "--num-decode-steps", "4") == out  # up to 4 tokens a call
        assert counts()[0] - calls <= 1 + -(-(len(want_ids) - 1) // 4)  # (one step at a time: a call a token)
        assert counts()[0] - calls + counts()[1] - more == len(want_ids)  # a forward per token, counted once


def test_generate_answers_a_question_with_the_real_model_and_its_chat_template(home: str) -> None:
    """`mlx-sidecar generate "What is the capital of France?"` on builtin:smollm2: a sensible answer."""
    question = "What is the capital of France?"
    # A small profile run: on the CPU backend each prompt token costs ~a decode step of this model.
    flags = ["--model", "builtin:smollm2", "--preload", "--max-num-batched-tokens", "8", "--max-num-seqs", "1"]
    with start_server(*flags, timeout=300) as s:
        out = subprocess.run([sys.executable, "-m", "sidecar", "generate", "--url", s.url, "--max-tokens", "7", question],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        assert "Paris" in out.stdout, out.stdout


def test_generate_with_ngram_speculation_prints_the_same_text(home: str, oracle_model) -> None:
    """`generate --speculative ngram` against a server running the n-gram proposer: the worker's
    drafts (take_draft_token_ids) are verified, the text is mlx-lm's greedy text, and the
    acceptance shows in the server's metrics."""
    tok = load_tokenizer(str(resolve_model("builtin:tiny", home)))
    prompt = "one two three one two three one two three one two"
    want_ids, _ = mlx_lm_greedy(oracle_model("builtin:tiny"), tok.encode(prompt).ids, 40)
    if 1 in want_ids:
        want_ids = want_ids[: want_ids.index(1) + 1]
    want = tok.decode(want_ids, skip_special_tokens=True)
    with start_server("--speculative-method", "ngram", "--prompt-lookup-min", "1", "--max-num-batched-tokens", "64",
                      "--max-num-seqs", "4") as s:  # small profile-run shapes: a quick start
        out = subprocess.run([sys.executable, "-m", "sidecar", "generate", "--url", s.url, "--max-tokens", "40",
                              "--speculative", "ngram", "--no-chat", prompt], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout == want + "\n"
        assert "drafts accepted" in out.stderr
        m = samples(scrape(s.url))
        drafted = m[("mlx_worker_spec_decode_draft_tokens_total", ())]
        accepted = m[("mlx_worker_spec_decode_accepted_tokens_total", ())]
        assert 0 < accepted <= drafted
        assert m[("mlx_worker_spec_decode_acceptance_ratio", ())] == accepted / drafted


def test_generate_survives_a_server_killed_and_restarted_mid_run(home: str) -> None:
    """kill -9 of the server while `generate` streams, a new one on the same port (as launchd
    would): the run waits, rebuilds the new server's state and prints the undisturbed text."""
    flags = ("--port", str(free_port()), "--preload", "--max-num-batched-tokens", "64", "--max-num-seqs", "4")
    argv = ["--max-tokens", "300", "--no-chat", "The lighthouse keeper"]
    server = start_server(*flags)
    try:
        want = _generate("--url", server.url, *argv)
        assert len(want) > 200  # long enough to be killed in the middle (greedy: always the same)
        proc = subprocess.Popen([sys.executable, "-m", "sidecar", "generate", "--url", server.url, *argv],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        first = proc.stdout.read(8)  # it is streaming
        server.stop(signal.SIGKILL)
        server = start_server(*flags)
        rest, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert "recovered: new instance" in err
        assert first + rest == want
    finally:
        server.stop()
