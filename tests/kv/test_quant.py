"""Quantised KV cache (kv_dtype 8bit/4bit): the pool holds mlx-lm's QuantizedKVCache layout, its page
sizes are exact, and greedy tokens and logprobs are mlx-lm's with the same KV quantisation through
batching, chunked prefill, prefix hits, block copies, preemption and sleep/wake."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from sidecar.errors import ProtocolError
from tests.driver import Driver
from tests.engine.test_model_runner import prompts

MODEL = "builtin:tiny-kv64"  # llama, 2 layers, 2 KV heads of 64, float32


def quant_greedy(model: object, prompt: list[int], n: int, bits: int | None) -> tuple[list[int], list[float]]:
    """The oracle: mlx-lm's generate_step with kv_bits and a QuantizedKVCache from the first token
    (bits None: mlx-lm unquantised)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import QuantizedKVCache

    layers = model.layers  # type: ignore[attr-defined]
    cache = [QuantizedKVCache(group_size=64, bits=bits) for _ in layers] if bits else None
    tokens, logprobs = [], []
    for tok, lp in generate_step(mx.array(prompt), model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1),
                                 prompt_cache=cache, kv_bits=bits, kv_group_size=64, quantized_kv_start=0):
        tokens.append(int(tok))
        logprobs.append(float(lp[int(tok)]))
    return tokens, logprobs


@pytest.fixture(scope="module")
def workers(make_worker) -> dict:
    return {8: make_worker(MODEL, kv_dtype="8bit"), 4: make_worker(MODEL, kv_dtype="4bit"),
            "fp": make_worker(MODEL, num_blocks=64)}


@pytest.mark.parametrize("bits", [8, 4])
def test_pool_holds_packed_kv_and_page_sizes_are_exact(workers, bits: int) -> None:
    w = workers[bits]
    s = w.get_kv_cache_spec()["model.layers.0.self_attn"]
    # Per token and head: packed data (64 values of `bits`), one float32 scale and bias (one group).
    per_vector = 64 * bits // 8 + 2 * 4
    assert s == {"type": "full_attention", "block_size": 16, "num_kv_heads": 2, "head_size": 64, "head_size_v": 64,
                 "dtype": "float32", "sliding_window": None, "page_size_bytes": 16 * 2 * 2 * per_vector,
                 "kv_quantization": {"bits": bits, "group_size": 64}}
    assert w.get_kv_cache_groups()[0]["kv_cache_spec"] == s
    block = w.get_cache_block_size_bytes()
    assert block == 2 * s["page_size_bytes"]
    pool = w.runner.pool
    data, scales, biases = pool.keys[0]
    assert (data.dtype, data.shape) == (mx.uint32, (1, 2, pool.sink + 1, 64 * bits // 32))
    assert (scales.dtype, scales.shape) == (mx.float32, (1, 2, pool.sink + 1, 1)) and biases.shape == scales.shape
    assert pool.nbytes == pool.num_blocks * block + 2 * 2 * 2 * 2 * per_vector  # + a scratch and a padding slot per K/V leaf
    # The same memory holds 256 / per_vector times the blocks of the float32 cache (3.6x, 6.4x),
    # and a pool of that many blocks fits it.
    assert workers["fp"].get_cache_block_size_bytes() == block * 256 // per_vector
    avail = w.determine_available_memory(kv_cache_memory_bytes=3 << 20)
    w.initialize_cache(avail // block, 0)
    assert w.runner.num_blocks == avail // block == (3 << 20) // (2 * 16 * 2 * 2 * per_vector)
    assert w.runner.pool.nbytes <= avail + 2 * 2 * 2 * 2 * per_vector
    w.initialize_cache(256, 0)


@pytest.mark.parametrize("bits", [8, 4])
def test_batched_chunked_matches_mlx_lm_quantized(workers, oracle_model, bits: int) -> None:
    w = workers[bits]
    ps = prompts(w.vocab_size(), [1, 7, 33, 70], seed=3)
    d = Driver(w.execute_model, 16, w.runner.num_blocks)
    for i, p in enumerate(ps):
        d.add(f"r{i}", p, {"temperature": 0.0, "logprobs": 0})
    got = d.run(20, chunk=16)
    model = oracle_model(MODEL)
    for i, p in enumerate(ps):
        want, want_lp = quant_greedy(model, p, 20, bits)
        assert got[f"r{i}"] == want, f"prompt {i} (len {len(p)})"
        np.testing.assert_allclose(d.reqs[f"r{i}"].logprobs[:20], want_lp, atol=1e-4)
        d.finish(f"r{i}")
    d.step()
    if bits == 4:  # negative control: unquantised K/V (ours and mlx-lm's) give other tokens
        d = Driver(workers["fp"].execute_model, 16, 64)
        for i, p in enumerate(ps):
            d.add(f"f{i}", p)
        plain = d.run(20, chunk=16)
        assert [plain[f"f{i}"] for i in range(len(ps))] == [quant_greedy(model, p, 20, None)[0] for p in ps]
        assert any(plain[f"f{i}"] != quant_greedy(model, p, 20, 4)[0] for i, p in enumerate(ps))


def test_prefix_hits_and_block_copies_read_the_quantised_blocks(workers, oracle_model) -> None:
    w = workers[4]
    bs = 16
    d = Driver(w.execute_model, bs, w.runner.num_blocks)
    shared = prompts(w.vocab_size(), [2 * bs], seed=4)[0]
    a = d.add("A", shared + [9, 10, 11])
    d.run(1)
    tail = [40, 41, 42, 43, 44]
    want = quant_greedy(oracle_model(MODEL), shared + tail, 8, 4)[0]
    # B hits A's two full blocks; C gets copies of them (kv_cache_block_copies in its first step).
    d.add("B", shared + tail, blocks=a.blocks[:2] + d.alloc(3), computed=2 * bs)
    copies = d.alloc(2)
    d.add("C", shared + tail, blocks=copies + d.alloc(3), computed=2 * bs)
    so = d.build(16)
    so["kv_cache_block_copies"] = [[a.blocks[0], copies[0]], [a.blocks[1], copies[1]]]
    d.commit(so, w.execute_model(so).to_wire())
    got = d.run(8)
    assert got["B"] == want and got["C"] == want
    for leaf in w.runner.pool.keys + w.runner.pool.values:  # every part of a copied block is equal
        for arr in leaf:
            src, dst = (np.array(arr[:, :, b * bs : (b + 1) * bs]) for b in (a.blocks[1], copies[1]))
            assert np.array_equal(src, dst)
    # Negative control: corrupting a shared block's packed data changes the tokens of a hit on it.
    for leaf in w.runner.pool.keys:
        leaf[0][:, :, a.blocks[1] * bs : (a.blocks[1] + 1) * bs] = mx.array(0x5A5A5A5A, mx.uint32)
    mx.eval(w.runner.pool.arrays())
    d.add("D", shared + tail, blocks=a.blocks[:2] + d.alloc(3), computed=2 * bs)
    assert d.run(8)["D"] != want
    for rid in list(d.reqs):
        d.finish(rid)
    d.step()


def test_preemption_and_sleep_wake_keep_mlx_lm_quantized_tokens(workers, oracle_model) -> None:
    w = workers[8]
    ps = prompts(w.vocab_size(), [20, 9], seed=5)
    model = oracle_model(MODEL)
    want = [quant_greedy(model, p, 12, 8)[0] for p in ps]
    d = Driver(w.execute_model, 16, w.runner.num_blocks)
    for i, p in enumerate(ps):
        d.add(f"y{i}", p)
    for _ in range(6):
        d.step(chunk=8)
    d.preempt("y0")
    d.step(chunk=8, only=["y1"])
    got = d.run(12, chunk=8)
    assert [got["y0"], got["y1"]] == want
    w.sleep(1)
    w.wake_up()
    assert w.runner.pool.keys[0][0].dtype == mx.uint32
    d = Driver(w.execute_model, 16, w.runner.num_blocks)
    d.add("z", ps[0])
    assert d.run(12, chunk=8)["z"] == want[0]


@pytest.mark.parametrize("model, words", [
    ("builtin:tiny", "layer 0 has head sizes 16/16, not multiples of the group size 64"),
    ("builtin:tiny-gemma3", "layer 0 has a sliding window of 8"),
    ("builtin:tiny-deepseek-v3", "layer 0 has an MLA latent cache"),
])
def test_layers_it_cannot_quantise_are_refused_at_load(make_worker, model: str, words: str) -> None:
    with pytest.raises(ProtocolError) as e:
        make_worker(model, kv_dtype="8bit")
    assert e.value.field == "config.kv_dtype" and words in str(e.value), str(e.value)


def test_serve_flag_and_init_device_override_over_a_real_server(home: str, oracle_model) -> None:
    """`serve --kv-dtype 8bit` serves mlx-lm's 8-bit-KV tokens; init_device may switch kv_dtype;
    a model it cannot quantise, or an unknown kv_dtype, is a 400 naming config.kv_dtype."""
    from sidecar.client.remote import RemoteError, RemoteWorker
    from tests.server.serverproc import start_server

    with start_server("--model", MODEL, "--kv-dtype", "8bit") as s:
        w = RemoteWorker(s.url)
        w.init_device()
        w.load_model()
        assert w.get_kv_cache_spec()["model.layers.1.self_attn"]["kv_quantization"] == {"bits": 8, "group_size": 64}
        w.initialize_cache(32, 0)
        d = Driver(w.execute_model, 16, 32)
        p = prompts(512, [21], seed=6)[0]
        d.add("a", p)
        assert d.run(10)["a"] == quant_greedy(oracle_model(MODEL), p, 10, 8)[0]
        for config, words in (({"model": "builtin:tiny"}, "head sizes 16/16"), ({"kv_dtype": "2bit"}, "8bit|4bit")):
            with pytest.raises(RemoteError) as e:
                w.call("init_device", config=config, reset=True)
                w.load_model()
            assert (e.value.status, e.value.field) == (400, "config.kv_dtype") and words in e.value.message, e.value
        w.call("init_device", config={"model": MODEL, "kv_dtype": "4bit"}, reset=True)
        w.load_model()
        assert w.get_kv_cache_spec()["model.layers.0.self_attn"]["kv_quantization"]["bits"] == 4
        w.close()
        assert s.stop() == 0, s.stderr()[-2000:]


def test_recurrent_layers_stay_unquantised_beside_quantised_attention(home: str, tmp_path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A hybrid (nemotron_h: mamba, attention, mlp) with heads of 64: its attention layer is
    quantised, its recurrent state is not (as mlx-lm's kv_bits leaves non-KVCache layers), and the
    tokens are mlx-lm's with that cache."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache
    from mlx_lm.utils import load_model

    from sidecar.config import Config
    from sidecar.models import families
    from sidecar.worker.mlx_worker import MLXWorker

    monkeypatch.setitem(families.FAMILIES, "nemotron_h", {**families.FAMILIES["nemotron_h"], "head_dim": 64})
    path = families.write("nemotron_h", tmp_path / "nemotron_h")
    w = MLXWorker(Config(model=str(path), home=home, kv_dtype="8bit", block_size=4))
    w.init_device()
    w.load_model()
    w.initialize_cache(64, 0)
    spec = w.get_kv_cache_spec()
    assert spec["model.layers.0.mixer"]["type"] == "mamba" and "kv_quantization" not in spec["model.layers.0.mixer"]
    assert spec["model.layers.1.self_attn"]["kv_quantization"] == {"bits": 8, "group_size": 64}
    model = load_model(path)[0]
    p = prompts(w.vocab_size(), [13], seed=7)[0]
    cache = [QuantizedKVCache(64, 8) if type(c) is KVCache else c for c in make_prompt_cache(model)]
    want = [int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=8, sampler=lambda x: mx.argmax(x, axis=-1),
                                             prompt_cache=cache, kv_bits=8, kv_group_size=64, quantized_kv_start=0)]
    d = Driver(w.execute_model, 4, 64)
    d.add("h", p)
    assert d.run(8, chunk=5)["h"] == want


def test_a_draft_model_runs_on_its_own_quantised_pool(make_worker, oracle_model) -> None:
    """The target as its own draft, both with 8-bit KV: every draft is accepted (k + 1 tokens a
    step) and the tokens are mlx-lm's with the same quantisation."""
    from tests.engine.test_proposers import _run

    k = 3
    w = make_worker(MODEL, num_blocks=64, kv_dtype="8bit", draft_model=MODEL, num_speculative_tokens=k)
    assert w.runner.proposer.runner.pool.keys[0][0].dtype == mx.uint32
    ps = {"a": prompts(512, [9], seed=8)[0]}
    got, d = _run(w, ps, 13)
    assert got["a"] == quant_greedy(oracle_model(MODEL), ps["a"], 13, 8)[0]
    assert {n for step in d.tokens_per_step for n in step} == {k + 1}, d.tokens_per_step
