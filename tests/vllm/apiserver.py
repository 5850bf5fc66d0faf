"""vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server --worker-cls ...`) as a real
process for the tests that need one, the streams they read from it, and the figures they read
from its log and from both servers' metrics."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx

from tests.server.serverproc import ROOT, free_port
from tests.vllm.conftest import WORKER_CLS


class Api:
    def __init__(self, proc: subprocess.Popen, url: str, log: Path):
        self.proc, self.url, self.log = proc, url, log

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def completion(self, prompt: list[int], max_tokens: int, **params: object) -> list[int]:
        """A streamed /v1/completions; its token ids."""
        ids: list[int] = []
        with httpx.stream("POST", f"{self.url}/v1/completions", json={
                "model": "m", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                "return_token_ids": True, "temperature": 0.0, **params}, timeout=600) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise RuntimeError(chunk["error"])
                    for c in chunk["choices"]:
                        ids += c.get("token_ids") or []
        return ids


@contextlib.contextmanager
def api_server(model_dir: str, additional_config: dict, log: Path, *args: str, env: dict | None = None,
               wait: bool = True, served: str = "m") -> Iterator[Api]:
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--worker-cls", WORKER_CLS,
           "--additional-config", json.dumps(additional_config), "--host", "127.0.0.1", "--port", str(port),
           "--block-size", "16", "--enforce-eager", "--served-model-name", served, *args]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                start_new_session=True)
    api = Api(proc, f"http://127.0.0.1:{port}", log)
    try:
        deadline = time.monotonic() + 600
        while wait:
            if proc.poll() is not None:
                raise RuntimeError(f"api_server exited with {proc.returncode}:\n{api.text()[-4000:]}")
            try:
                if httpx.get(f"{api.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(api.text()[-4000:])
            time.sleep(1)
        yield api
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def assert_scheduling(api: Api, flag: str) -> None:
    """The worker class really ran as asked (both runs could otherwise have been one kind)."""
    m = re.search(r"MLX sidecar at \S+ initialised \((.*)\)$", api.text(), re.M)
    assert m is not None, "the worker's start-up line is missing"
    assert m.group(1).endswith(", async scheduling") is (flag == "--async-scheduling")


def recovery_lines(api: Api) -> list[dict]:
    """The worker's machine-readable line per recovery (sidecar/vllm/recovery.py)."""
    return [json.loads(m) for m in re.findall(r"mlx_sidecar_recovery (\{.*\})$", api.text(), re.M)]


def steps(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(float(m) for m in re.findall(r"^mlx_worker_step_duration_seconds_count(?:\{[^}]*\})? (\S+)", text, re.M))


def prefix_hits(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(float(m) for m in re.findall(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)", text, re.M))
