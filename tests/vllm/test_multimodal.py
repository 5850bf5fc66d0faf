"""Images through an unmodified vLLM 0.32 and a real sidecar (builtin:tiny-idefics3): vLLM's own
processor prepares the image, our worker class sends its mm_features and encoder instructions,
the sidecar runs mlx-vlm's model code; greedy tokens equal mlx-vlm's own generate.

Idefics3 (SmolVLM's architecture) is the family served through vLLM here: vLLM's Qwen2-VL, Qwen2.5-VL
and Gemma 3 model modules import transformers' torchvision image processors, and torchvision has
no build for the CPU torch of vLLM's CPU wheel on the registries; the sidecar serves those
families without vLLM (tests/engine/test_multimodal.py).
"""

from __future__ import annotations

import base64
import io
import subprocess

import httpx
import numpy as np
import pytest
import torch
from vllm.multimodal.inputs import MultiModalFeatureSpec, MultiModalFieldElem, MultiModalKwargsItem, PlaceholderRange
from vllm.multimodal.inputs import MultiModalBatchedField

from sidecar.vllm import multimodal
from sidecar.wire.multimodal import features
from tests.vllm import apiserver
from tests.vllm.conftest import MAIN_PYTHON, WORKER_CLS, counter, oracle, sidecar_url_config

MODEL = "builtin:tiny-idefics3"
TEXT = "Describe the sea."
N = 8


def test_features_convert_to_the_wire_and_back() -> None:
    pv = torch.randn(1, 3, 56, 56)
    item = MultiModalKwargsItem({"pixel_values": MultiModalFieldElem(pv, MultiModalBatchedField())})
    spec = MultiModalFeatureSpec(data=item, modality="image", identifier="lora1:abc", mm_hash="abc",
                                 mm_position=PlaceholderRange(offset=3, length=8,
                                                              is_embed=torch.tensor([0, 0, 1, 1, 1, 1, 0, 0]).bool()))
    wire = multimodal.features([spec])
    back = features(wire, "f", prompt_len=11)[0]
    assert back.identifier == "lora1:abc" and back.mm_hash == "abc"
    assert back.mm_position.is_embed == [False, False, True, True, True, True, False, False]
    assert np.array_equal(back.data["pixel_values"], pv.numpy())
    bf = MultiModalKwargsItem({"pixel_values": MultiModalFieldElem(pv.bfloat16(), MultiModalBatchedField())})
    spec.data = bf
    assert features(multimodal.features([spec]), "f", 11)[0].data["pixel_values"].dtype == np.float32


@pytest.mark.parametrize("model, size", [(MODEL, [70, 90]), ("builtin:tiny-gemma3-vl", [70, 90]),
                                         ("builtin:tiny-qwen2-vl", [70, 90]), ("builtin:tiny-smolvlm", [70, 90]),
                                         ("builtin:tiny-glm4v", [70, 90]), ("builtin:tiny-internvl", [80, 150]),
                                         ("builtin:tiny-internvl", [200, 50])])
def test_the_pixels_vllms_processor_sends_are_mlx_vlms(model: str, size: list[int], vllm_model_dir) -> None:
    """transformers' image processor (what vLLM's processor calls) and mlx-vlm's, on the same image:
    within 1e-6. (Qwen2-VL, SmolVLM, GLM-4.1V, InternVL: their PIL image processors; the whole
    processors need torchvision here.)"""
    _need_vision()
    from PIL import Image
    from transformers import AutoProcessor

    want = oracle({"vlm": model, "text": TEXT, "image_seed": 3, "size": size, "max_tokens": 1}, "")
    img = Image.open(io.BytesIO(base64.b64decode(want["png"]))).convert("RGB")
    if "qwen2" in model:
        from transformers import Qwen2VLImageProcessorPil

        image_processor = Qwen2VLImageProcessorPil.from_pretrained(vllm_model_dir(model))
    elif "smolvlm" in model:
        from transformers import SmolVLMImageProcessorPil

        image_processor = SmolVLMImageProcessorPil.from_pretrained(vllm_model_dir(model))
    elif "glm4v" in model:
        from transformers import Glm4vImageProcessorPil

        image_processor = Glm4vImageProcessorPil.from_pretrained(vllm_model_dir(model))
    elif "internvl" in model:
        from transformers import GotOcr2ImageProcessorPil

        image_processor = GotOcr2ImageProcessorPil.from_pretrained(vllm_model_dir(model))
    else:
        image_processor = AutoProcessor.from_pretrained(vllm_model_dir(model)).image_processor
    got = image_processor(images=[img], return_tensors="np")["pixel_values"]
    ref = np.asarray(want["pixel_values"], np.float32)
    assert np.abs(got.reshape(ref.shape) - ref).max() <= 1e-6


def test_internvls_processors_differ_on_the_grid_of_some_near_square_images(vllm_model_dir) -> None:
    """Between two tile grids of the same aspect ratio (1x1 and 2x2 for a 70x90 image), InternVL's
    own rule, which transformers' processor keeps, takes the larger once the image covers half of
    it; mlx-vlm's takes the one closer to the image's area. Each request is served as its processor
    made it (the placeholder holds as many tiles as the pixels have)."""
    _need_vision()
    from PIL import Image
    from transformers import GotOcr2ImageProcessorPil

    model = "builtin:tiny-internvl"
    want = oracle({"vlm": model, "text": TEXT, "image_seed": 3, "size": [70, 90], "max_tokens": 1}, "")
    img = Image.open(io.BytesIO(base64.b64decode(want["png"]))).convert("RGB")
    got = GotOcr2ImageProcessorPil.from_pretrained(vllm_model_dir(model))(images=[img], return_tensors="np")
    assert np.asarray(want["pixel_values"]).shape[0] == 1 and got["pixel_values"].shape[0] == 5


def _need_vision() -> None:
    """Skip unless the sidecar's venv has the vision extra (`make test-vllm` installs it)."""
    if subprocess.run([MAIN_PYTHON, "-c", "import mlx_vlm"], capture_output=True).returncode != 0:
        pytest.skip("the vision extra is not installed in the sidecar's venv (make install-vision)")


@pytest.fixture(scope="module")
def engine(home: str, vllm_model_dir):
    _need_vision()
    from vllm import LLM

    from tests.server.serverproc import start_server

    with start_server("--model", MODEL) as server:
        llm = LLM(model=vllm_model_dir(MODEL), worker_cls=WORKER_CLS, additional_config=sidecar_url_config(server.url),
                  block_size=16, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
                  kv_cache_memory_bytes=64 * 16 * 2 * 32 * 4 * 2, enable_prefix_caching=True, enforce_eager=True,
                  disable_log_stats=False, seed=0, limit_mm_per_prompt={"image": 2})
        try:
            yield llm, server
        finally:
            llm.llm_engine.engine_core.shutdown()


def _image(seed: int, size=(80, 100), text: str = TEXT, image_first: bool = False) -> tuple[dict, object]:
    from PIL import Image

    want = oracle({"vlm": MODEL, "text": text, "image_seed": seed, "size": list(size), "max_tokens": N,
                   "image_first": image_first}, "")
    return want, Image.open(io.BytesIO(base64.b64decode(want["png"]))).convert("RGB")


def _encoder_metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {line.split()[0]: float(line.split()[-1]) for line in text.splitlines()
            if line.startswith("mlx_worker_encoder")}


def test_generate_with_images_equals_mlx_vlm_and_a_repeated_image_runs_the_encoder_once(engine) -> None:
    from vllm import SamplingParams

    llm, server = engine
    a, img_a = _image(0)
    a2, _ = _image(0, text="Look at it.")
    b, img_b = _image(4, (120, 60))

    def prompt(text: str) -> str:
        return "<|begin_of_text|>User:" + text + "<image><end_of_utterance>\nAssistant:"

    greedy = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    before = _encoder_metrics(server.url)
    hits = counter(llm, "vllm:mm_cache_hits")
    outs = llm.generate([{"prompt": prompt(TEXT), "multi_modal_data": {"image": img_a}},
                         {"prompt_token_ids": list(range(5, 40))},
                         {"prompt": prompt(TEXT), "multi_modal_data": {"image": img_b}}], greedy, use_tqdm=False)
    assert list(outs[0].prompt_token_ids) == a["prompt"]  # vLLM's processor made mlx-vlm's prompt
    assert list(outs[0].outputs[0].token_ids) == a["tokens"]
    assert list(outs[2].outputs[0].token_ids) == b["tokens"] != a["tokens"]
    # the same image after other text (no prefix-cache hit): vLLM schedules no encoder input for it
    again = llm.generate([{"prompt": prompt("Look at it."), "multi_modal_data": {"image": img_a}},
                          {"prompt": prompt(TEXT), "multi_modal_data": {"image": img_a}}], greedy, use_tqdm=False)
    assert list(again[0].outputs[0].token_ids) == a2["tokens"] and list(again[1].outputs[0].token_ids) == a["tokens"]
    after = _encoder_metrics(server.url)
    d = {k: after[k] - before.get(k, 0) for k in after}
    assert d["mlx_worker_encoder_runs_total"] == 2  # img_a once for the three requests that carry it
    assert d["mlx_worker_encoder_cache_hits_total"] >= 2
    assert counter(llm, "vllm:mm_cache_hits") - hits >= 2  # vLLM saw the same image content again


def test_a_repeated_image_reuses_the_kv_past_it_and_no_encoder_runs(engine) -> None:
    """The image before the question: a later request with the same image and another question,
    and the identical request, hit vLLM's prefix cache up to and past the image (its block hashes
    take the image's hash); the sidecar computes only the tail, without the encoder. Another image
    under the same tokens hits only the text before it."""
    from vllm import SamplingParams

    llm, server = engine
    first, img = _image(11, image_first=True)
    follow, _ = _image(11, text="What colour is it?", image_first=True)
    other, img_other = _image(12, image_first=True)

    def prompt(text: str) -> str:
        return "<|begin_of_text|>User:<image>" + text + "<end_of_utterance>\nAssistant:"

    greedy = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    p = first["prompt"]
    end = max(i for i, t in enumerate(p) if t == max(set(p), key=p.count)) + 1  # past the image's tokens
    before = _encoder_metrics(server.url)
    outs = []
    for text, pic in [(TEXT, img), ("What colour is it?", img), (TEXT, img), (TEXT, img_other)]:
        outs += llm.generate([{"prompt": prompt(text), "multi_modal_data": {"image": pic}}], greedy, use_tqdm=False)
    assert [list(o.prompt_token_ids) for o in outs[:2]] == [first["prompt"], follow["prompt"]]
    assert [list(o.outputs[0].token_ids) for o in outs] == [first["tokens"], follow["tokens"], first["tokens"],
                                                            other["tokens"]]
    assert other["prompt"] == first["prompt"] and other["tokens"] != first["tokens"]  # only the image differs
    cached = [o.num_cached_tokens for o in outs]
    assert cached[1] >= end - 16 and cached[2] == (len(first["prompt"]) - 1) // 16 * 16 > end, (cached, end)
    assert cached[3] < 16  # another image: its blocks hash differently from the first one it overlaps
    d = {k: v - before.get(k, 0) for k, v in _encoder_metrics(server.url).items()}
    assert d["mlx_worker_encoder_runs_total"] == 2  # the first image once, the other once


def test_chat_completions_with_an_image_data_url(engine) -> None:
    llm, _ = engine
    want, _ = _image(7)
    url = "data:image/png;base64," + want["png"]
    out = llm.chat([{"role": "user", "content": [{"type": "text", "text": TEXT},
                                                 {"type": "image_url", "image_url": {"url": url}}]}],
                   __import__("vllm").SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True), use_tqdm=False)
    assert list(out[0].prompt_token_ids) == want["prompt"]
    assert list(out[0].outputs[0].token_ids) == want["tokens"]


def test_openai_chat_completions_with_an_image_data_url(home: str, vllm_model_dir, tmp_path) -> None:
    """The OpenAI server's /v1/chat/completions, image_url content as a data URL (no network)."""
    _need_vision()
    from tests.server.serverproc import start_server

    want, _ = _image(9, (90, 70))
    content = [{"type": "text", "text": TEXT},
               {"type": "image_url", "image_url": {"url": "data:image/png;base64," + want["png"]}}]
    with start_server("--model", MODEL) as sidecar, \
            apiserver.api_server(vllm_model_dir(MODEL), sidecar_url_config(sidecar.url), tmp_path / "api.log",
                                 "--kv-cache-memory-bytes", str(1 << 20), "--max-model-len", "256", served="tiny-vl") as api:
        r = httpx.post(f"{api.url}/v1/chat/completions", json={
            "model": "tiny-vl", "messages": [{"role": "user", "content": content}], "max_tokens": N,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}, timeout=300)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["prompt_token_ids"] == want["prompt"]
        assert body["choices"][0]["token_ids"] == want["tokens"]
        metrics = _encoder_metrics(sidecar.url)
        assert metrics["mlx_worker_encoder_runs_total"] == 1


def test_requests_with_images_survive_a_sidecar_restart(home: str, vllm_model_dir, tmp_path) -> None:
    """kill -9 of the sidecar while requests with images decode, a new one on the same port: the
    worker class refills their KV with the images encoded again (the pixels vLLM sent once), the
    streams end with mlx-vlm's tokens, and a repeat of one request hits the refilled blocks past
    its image in vLLM's prefix cache and still gives mlx-vlm's tokens."""
    _need_vision()
    import signal
    import threading
    import time

    from tests.server.serverproc import free_port, start_server
    from tests.vllm.apiserver import api_server, prefix_hits, recovery_lines, steps

    n, seeds = 96, [21, 22, 21, 23]  # (long enough that the kill lands mid-stream)
    want = {s: oracle({"vlm": MODEL, "text": TEXT, "image_seed": s, "size": [80, 100], "max_tokens": n}, "")
            for s in set(seeds)}

    def chat(seed: int) -> list[int]:
        content = [{"type": "text", "text": TEXT},
                   {"type": "image_url", "image_url": {"url": "data:image/png;base64," + want[seed]["png"]}}]
        r = httpx.post(f"{api.url}/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}, timeout=600)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    flags = ("--model", MODEL, "--port", str(free_port()))
    sidecar = start_server(*flags)
    try:
        with api_server(vllm_model_dir(MODEL), {"mlx_sidecar": {"url": sidecar.url, "recover_timeout": 120}},
                        tmp_path / "api.log", "--kv-cache-memory-bytes", str(1 << 20), "--max-model-len", "512",
                        "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--async-scheduling") as api:
            results: dict[int, list[int]] = {}
            errors: list[BaseException] = []

            def run(i: int) -> None:
                try:
                    results[i] = chat(seeds[i])
                except BaseException as e:  # noqa: BLE001 (reported below)
                    errors.append(e)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(len(seeds))]
            before = steps(sidecar.url)
            for t in threads:
                t.start()
            deadline = time.monotonic() + 120
            while steps(sidecar.url) <= before + 10:  # past the prefills (4 x 99 tokens, 64 a step): decoding
                assert not errors and time.monotonic() < deadline, (errors, api.text()[-3000:])
                time.sleep(0.05)
            sidecar.send_signal(signal.SIGKILL)
            sidecar.wait(30)
            sidecar = start_server(*flags)
            for t in threads:
                t.join(600)
            assert not errors, errors
            lines = recovery_lines(api)
            assert len(lines) == 1, "no recovery: the kill came after the streams ended"
            (line,) = lines
            assert line["refilled_tokens"] > 0
            for i, s in enumerate(seeds):
                assert results[i] == want[s]["tokens"], f"request {i} (image {s})"
            assert _encoder_metrics(sidecar.url)["mlx_worker_encoder_runs_total"] >= 1  # the refill encoded
            hits = prefix_hits(api.url)
            assert chat(21) == want[21]["tokens"]
            assert prefix_hits(api.url) - hits > want[21]["prompt"].index(max(set(want[21]["prompt"]),
                                                                              key=want[21]["prompt"].count))
    finally:
        sidecar.stop()
