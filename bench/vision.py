"""The images stage: a repeated image's time to first token against its first occurrence, and end
to end against mlx-vlm's own generate, through a real server and the reference scheduler (vLLM's
CPU build here has no processor for the Qwen families: docs/vllm.md, Images).

TTFT runs on builtin:small-qwen2.5-vl, whose vision tower costs what Qwen2.5-VL-7B's does against
its language model (0.38 of a token's multiply-adds per image token; 7B: 0.39) on images of 256
tokens. Each round brings a new image, first asked about with the image before the question, then
(each alone, in this order) the same image with another question (the prefix cache covers the
image: only the question is computed), the identical request (only its last block), and the same
image after other text (only the text before the image can be shared: the encoder run is the
saving). TTFT is from handing the request to the scheduler; the processor (mlx-vlm's, the
scheduler's side, as vLLM's frontend) is timed apart. End to end includes the processor on both
sides, each side sees a new image, and both end at the request's last token (mlx-vlm's generate
returns right after it; the reference scheduler then sends the worker one more step, the
request's finished id, which no client waits for). mlx-vlm's side also detokenizes each token,
which the sidecar leaves to vLLM's frontend (microseconds a token).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np

MODEL = "builtin:small-qwen2.5-vl"
TINY = "builtin:tiny-qwen2-vl"
QUESTION, FOLLOW_UP, OTHER = "Describe the sea.", "What colour is the boat?", "Look at this picture."
# End to end, the reference scheduler's ways of stepping: one step at a time, two in flight, and
# up to DECODE_STEPS decode steps per call (the single stream's fewest round trips).
MODES, DECODE_STEPS = ("sync", "pipelined", "steps"), 16


def _png(dest: Path, seed: int, side: int) -> Path:
    from PIL import Image

    p = dest / f"img{seed}-{side}.png"
    Image.fromarray((np.random.default_rng(seed).random((side, side, 3)) * 255).astype("uint8")).save(p)
    return p


def _encoder_seconds(url: str) -> float:
    import httpx

    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("mlx_worker_encoder_seconds_total"):
            return float(line.split()[-1])
    return 0.0


@contextmanager
def _served(model: str, home: str | None, log_dir: str) -> Iterator[tuple[Any, Any, Path]]:
    """A server for `model` and a request runner: one(rid, text, image, images_first, max_tokens)
    -> (TTFT, end to end, processor seconds, prefix-cached tokens, output tokens). End to end ends
    at the request's last token, as its client sees it (the step that then tells the worker the
    request finished is bookkeeping after it)."""
    from bench.sides import ServerProcess
    from sidecar.client.pipeline import Pipeline
    from sidecar.client.remote import RemoteWorker
    from sidecar.models import resolve_model
    from sidecar.scheduler.generate import wait_and_bring_up
    from sidecar.scheduler.images import prepare
    from sidecar.scheduler.pipelined import run_pipelined
    from sidecar.scheduler.scheduler import Request, Scheduler, run

    path = resolve_model(model, home)
    server = ServerProcess(model, home, log_dir=log_dir, extra={"max_num_seqs": 4, "max_num_batched_tokens": 512})
    worker = None
    try:
        server.start()
        worker = RemoteWorker(server.url)
        wait_and_bring_up(worker, lambda _: None, max_blocks=512)
        info = worker.info()
        sched = Scheduler(num_blocks=info["num_blocks"], block_size=info["block_size"], max_num_batched_tokens=512)
        step = (lambda so: worker.call("execute_model", scheduler_output=so))

        def one(rid: str, text: str, img: Path, images_first: bool = True, max_tokens: int = 1,
                mode: str = "sync") -> tuple[float, float, float, int, list[int]]:
            t0 = time.perf_counter()
            ids, features = prepare(path, text, [img], images_first)
            t1 = time.perf_counter()
            sched.add_request(Request(rid, ids, {"temperature": 0.0}, max_tokens=max_tokens, ignore_eos=True,
                                      mm_features=features))
            first: list[float] = []
            last: list[float] = []

            def event(e: Any) -> None:
                now = time.perf_counter()
                if not first:
                    first.append(now)
                if e.req_id == rid and e.finished:
                    last.append(now)
            sched.num_decode_steps = DECODE_STEPS if mode == "steps" else 1  # `generate --num-decode-steps`
            if mode == "pipelined":  # two steps in flight (vLLM's async scheduling; `generate --pipeline 1`)
                pipe = Pipeline(server.url)  # (a fresh connection: the server drops idle ones)
                try:
                    done = run_pipelined(sched, lambda so: pipe.submit("execute_model", scheduler_output=so),
                                         pipe.collect, on_event=event)
                finally:
                    pipe.close()
            else:
                done = run(sched, step, on_event=event)
            r = done[rid]
            return first[0] - t1, last[0] - t0, t1 - t0, r.num_cached_tokens, r.output_token_ids

        yield one, server, path
    finally:
        if worker is not None:
            worker.close()
        server.stop()


def _ttft(b: Any, tmp: Path, log_dir: str, rounds: int) -> None:
    with _served(MODEL, b.params.home, log_dir) as (one, server, _):
        one("warm", QUESTION, _png(tmp, 1000, 448))
        t: dict[str, list[float]] = {"first": [], "follow_up": [], "identical": [], "encoder_only": []}
        cached: dict[str, int] = {}
        share, processor = [], []
        for i in range(rounds):
            img = _png(tmp, i, 448)
            enc = _encoder_seconds(server.url)
            ttft, _, proc_s, cached["first"], _ = one(f"first{i}", QUESTION, img)
            t["first"].append(ttft)
            share.append((_encoder_seconds(server.url) - enc) / ttft)
            processor.append(proc_s)
            for case, text, first in [("follow_up", FOLLOW_UP, True), ("identical", QUESTION, True),
                                      ("encoder_only", OTHER, False)]:
                ttft, _, _, cached[case], _ = one(f"{case}{i}", text, img, first)
                t[case].append(ttft)
    med = {k: statistics.median(v) for k, v in t.items()}
    r = b.results
    r.update(image_model=MODEL, image_rounds=rounds, image_encoder_share=statistics.median(share),
             image_processor_ms=statistics.median(processor) * 1e3)
    for case, v in med.items():
        r[f"image_ttft_{case}_ms"] = v * 1e3
        r[f"image_cached_{case}_tokens"] = cached[case]
        if case != "first":
            r[f"image_ttft_{case}_ratio"] = v / med["first"]
    b.notes.append(
        f"images ({MODEL}, {rounds} rounds): TTFT first {med['first'] * 1e3:.0f} ms (encoder "
        f"{r['image_encoder_share']:.0%} of it; processor {r['image_processor_ms']:.0f} ms before it); the same image "
        f"with another question {r['image_ttft_follow_up_ratio']:.2f}x ({cached['follow_up']} tokens cached), "
        f"identical {r['image_ttft_identical_ratio']:.2f}x ({cached['identical']} cached), after other text "
        f"(encoder cache only) {r['image_ttft_encoder_only_ratio']:.2f}x (goal <= 0.2x)")


def _e2e(b: Any, tmp: Path, log_dir: str, model: str, key: str, side: int, rounds: int) -> None:
    """mlx-vlm's generate in this process against one request through the server, interleaved."""
    from mlx_vlm import generate
    from mlx_vlm.utils import load_model, load_processor
    from PIL import Image

    with _served(model, b.params.home, log_dir) as (one, _, path):
        vlm, proc = load_model(path), load_processor(path)
        prompt = proc.tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
            add_generation_prompt=True, tokenize=False)
        theirs: list[float] = []
        ours: dict[str, list[float]] = {m: [] for m in MODES}
        same, n = True, 32
        for i in range(rounds + 1):  # the first round warms both sides up
            for j, mode in enumerate(MODES):  # each side sees the image first: no cache helps the server
                img = _png(tmp, 500 + len(MODES) * i + j, side)
                t0 = time.perf_counter()
                res = generate(vlm, proc, prompt, image=[Image.open(img).convert("RGB")], max_tokens=n,
                               temperature=0.0, verbose=False)
                mlx_vlm_s = time.perf_counter() - t0
                n = int(res.generation_tokens) if not i else n
                ref = list(res.token_ids)[:n]  # (mlx-vlm's stops at an end-of-sequence token)
                _, sidecar_s, _, _, tokens = one(f"e2e{i}-{mode}", QUESTION, img, True, n, mode)
                same = same and tokens[:len(ref)] == ref
                if i:
                    theirs.append(mlx_vlm_s)
                    ours[mode].append(sidecar_s)
    mlx_vlm_s = statistics.median(theirs)
    med = {m: statistics.median(v) for m, v in ours.items()}
    b.results.update({f"{key}_model": model, f"{key}_tokens": n, f"{key}_mlx_vlm_s": mlx_vlm_s,
                      f"{key}_sidecar_s": med["steps"], f"{key}_ratio": mlx_vlm_s / med["steps"],
                      f"{key}_tokens_match": int(same)})
    for m in ("sync", "pipelined"):
        b.results.update({f"{key}_{m}_sidecar_s": med[m], f"{key}_{m}_ratio": mlx_vlm_s / med[m]})
    b.notes.append(f"images ({model}): end to end, {n} tokens from a {side}-pixel image: {mlx_vlm_s / med['steps']:.2f}x "
                   f"mlx-vlm's generate with up to {DECODE_STEPS} decode steps a call, "
                   f"{mlx_vlm_s / med['pipelined']:.2f}x with two steps in flight, {mlx_vlm_s / med['sync']:.2f}x one "
                   f"at a time (goal >= 0.9), tokens equal: {same}")


def images(b: Any, log_dir: str, rounds: int = 5) -> None:
    try:
        import mlx_vlm  # noqa: F401
    except ImportError:
        b.notes.append("images: skipped (the vision extra is not installed: make install-vision)")
        return
    with tempfile.TemporaryDirectory(prefix="bench-images-") as tmp:
        _ttft(b, Path(tmp), log_dir, rounds)
        _e2e(b, Path(tmp), log_dir, MODEL, "image_e2e", 448, max(1, rounds // 2))
        _e2e(b, Path(tmp), log_dir, TINY, "image_e2e_tiny", 112, 2 * rounds)  # (40 ms a request: rounds are cheap, noise is not)
