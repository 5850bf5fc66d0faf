"""Unmodified vLLM 0.32's pooling runner (`runner="pooling"`, `--runner pooling`) over a real sidecar:
offline `LLM.embed/classify/score` and the OpenAI server's /v1/embeddings (float and base64),
/v1/score and /v1/rerank give mlx-lm's own final hidden states pooled by hand (fp32: 1e-5).

The embedding model pools its last token (its sentence-transformers config), so vLLM keeps prefix
caching and chunked prefill on: prompts sharing two full blocks and prompts longer than the token
budget exercise both."""

from __future__ import annotations

import base64
import random

import httpx
import numpy as np
import pytest
from vllm import LLM
from vllm.pooling_params import PoolingParams

from tests.server.serverproc import start_server
from tests.vllm import apiserver
from tests.vllm.conftest import WORKER_CLS, oracle, sidecar_url_config

EMBED, CLASSIFY = "builtin:tiny-embed", "builtin:tiny-classify"


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 500) for _ in range(32)]  # two full blocks: prefix-cache hits
    ps = [shared + [rng.randrange(3, 500) for _ in range(n)] for n in (3, 11)]
    return ps + [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 9, 45, 70)]  # > 32: chunked


def normalise(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


def pooled(home: str, model: str, ps: list[list[int]], score: bool = False) -> np.ndarray:
    return np.array(oracle({"model": model, "prompts": ps, "pool": "LAST", "score": score}, home))


@pytest.fixture(scope="module", params=[EMBED, CLASSIFY])
def engine(request: pytest.FixtureRequest, home: str, vllm_model_dir):
    name = request.param
    with start_server("--model", name) as server:
        llm = LLM(model=vllm_model_dir(name), runner="pooling", worker_cls=WORKER_CLS,
                  additional_config=sidecar_url_config(server.url), kv_cache_memory_bytes=1 << 20, block_size=16,
                  max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32, enforce_eager=True, seed=0)
        try:
            yield name, llm
        finally:
            llm.llm_engine.engine_core.shutdown()


def test_offline_embed_classify_and_score(engine, home: str) -> None:
    name, llm = engine
    ps = prompts(1)
    if name == EMBED:
        llm.embed([{"prompt_token_ids": ps[0]}], use_tqdm=False)  # its full blocks are cached for ps[1]
        outs = llm.embed([{"prompt_token_ids": p} for p in ps], use_tqdm=False)
        want = normalise(pooled(home, name, ps))
        for o, w in zip(outs, want):
            np.testing.assert_allclose(o.outputs.embedding, w, atol=1e-5)
        assert outs[1].num_cached_tokens >= 32  # the shared prefix came from the cache, and LAST is exact
        dims = llm.embed([{"prompt_token_ids": ps[2]}], pooling_params=PoolingParams(dimensions=8), use_tqdm=False)
        np.testing.assert_allclose(dims[0].outputs.embedding, normalise(pooled(home, name, [ps[2]])[0][:8]), atol=1e-5)
        # Bi-encoder score: the cosine of the two embeddings.
        sc = llm.score("The lighthouse keeper", ["rose before the sun", "a grey sea"], use_tqdm=False)
        tok = llm.get_tokenizer()
        q, *docs = normalise(pooled(home, name, [tok("The lighthouse keeper")["input_ids"]] +
                                    [tok(d)["input_ids"] for d in ("rose before the sun", "a grey sea")]))
        assert [s.outputs.score for s in sc] == pytest.approx([float(q @ d) for d in docs], abs=1e-5)
    else:
        outs = llm.classify([{"prompt_token_ids": p} for p in ps], use_tqdm=False)
        want = sigmoid(pooled(home, name, ps, score=True))
        for o, w in zip(outs, want):
            np.testing.assert_allclose(o.outputs.probs, w, atol=1e-5)
        # Cross-encoder score: each (query, document) pair is one prompt through the classifier.
        sc = llm.score("The lighthouse keeper", ["rose before the sun", "a grey sea"], use_tqdm=False)
        want = sigmoid(pooled(home, name, [s.prompt_token_ids for s in sc], score=True))[:, 0]
        assert [s.outputs.score for s in sc] == pytest.approx(want.tolist(), abs=1e-5)
        assert abs(sc[0].outputs.score - sc[1].outputs.score) > 1e-3  # the documents score differently


@pytest.fixture(scope="module", params=[EMBED, CLASSIFY])
def api(request: pytest.FixtureRequest, home: str, vllm_model_dir, tmp_path_factory: pytest.TempPathFactory):
    name = request.param
    log = tmp_path_factory.mktemp("api") / "api_server.log"
    with start_server("--model", name) as sidecar, apiserver.api_server(
            vllm_model_dir(name), sidecar_url_config(sidecar.url), log, "--runner", "pooling",
            "--kv-cache-memory-bytes", str(1 << 20), "--max-model-len", "128") as server:
        yield name, server.url


def test_openai_embeddings_score_and_rerank(api, home: str) -> None:
    name, url = api
    ps = prompts(2)[2:5]
    if name == EMBED:
        want = normalise(pooled(home, name, ps))
        r = httpx.post(f"{url}/v1/embeddings", json={"model": "m", "input": ps}, timeout=120)
        assert r.status_code == 200, r.text
        got = [d["embedding"] for d in sorted(r.json()["data"], key=lambda d: d["index"])]
        np.testing.assert_allclose(got, want, atol=1e-5)
        r = httpx.post(f"{url}/v1/embeddings", json={"model": "m", "input": ps, "encoding_format": "base64"},
                       timeout=120)
        assert r.status_code == 200, r.text
        for d in r.json()["data"]:
            vec = np.frombuffer(base64.b64decode(d["embedding"]), dtype=np.float32)
            np.testing.assert_allclose(vec, want[d["index"]], atol=1e-5)
        r = httpx.post(f"{url}/v1/embeddings", json={"model": "m", "input": ps[:1], "dimensions": 4}, timeout=120)
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(r.json()["data"][0]["embedding"], normalise(pooled(home, name, ps[:1])[0][:4]),
                                   atol=1e-5)
        return
    docs = ["rose before the sun", "a grey sea", "the baker was already at work"]
    r = httpx.post(f"{url}/v1/score", json={"model": "m", "text_1": "The lighthouse keeper", "text_2": docs},
                   timeout=120)
    assert r.status_code == 200, r.text
    scores = [d["score"] for d in sorted(r.json()["data"], key=lambda d: d["index"])]
    r = httpx.post(f"{url}/v1/rerank", json={"model": "m", "query": "The lighthouse keeper", "documents": docs},
                   timeout=120)
    assert r.status_code == 200, r.text
    ranked = r.json()["results"]
    assert [x["index"] for x in ranked] == sorted(range(3), key=lambda i: -scores[i])
    assert [x["relevance_score"] for x in ranked] == pytest.approx(sorted(scores, reverse=True), abs=1e-6)
    # The oracle on the pair prompts vLLM built: tokenised by vLLM's own tokenizer the same way.
    tok = httpx.post(f"{url}/tokenize", json={"model": "m", "prompt": "The lighthouse keeper"}, timeout=60).json()
    pairs = [tok["tokens"] + httpx.post(f"{url}/tokenize", json={"model": "m", "prompt": d}, timeout=60).json()["tokens"]
             for d in docs]
    assert scores == pytest.approx(sigmoid(pooled(home, name, pairs, score=True))[:, 0].tolist(), abs=1e-5)
