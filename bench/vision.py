"""The images stage: a repeated image's time to first token against its first occurrence, and
end to end against mlx-vlm's own generate, on builtin:tiny-qwen2-vl through a real server and the
reference scheduler (vLLM's CPU build here has no processor for this family: README, Images).

First occurrences use a new image each; a repeat asks about an image seen before under other text,
so no prefix-cache hit covers it and the only saving is the encoder run the cache skips. On a tiny
model the vision tower is a small share of a prefill: the ratio says what the cache saves there.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

MODEL = "builtin:tiny-qwen2-vl"


def _png(dest: Path, seed: int) -> Path:
    from PIL import Image

    p = dest / f"img{seed}.png"
    Image.fromarray((np.random.default_rng(seed).random((112, 112, 3)) * 255).astype("uint8")).save(p)
    return p


def images(b: Any, log_dir: str) -> None:
    try:
        import mlx_vlm  # noqa: F401
    except ImportError:
        b.notes.append("images: skipped (the vision extra is not installed: make install-vision)")
        return
    from mlx_vlm import generate
    from mlx_vlm.utils import load_model, load_processor
    from PIL import Image

    from bench.sides import ServerProcess
    from sidecar.client.remote import RemoteWorker
    from sidecar.models import resolve_model
    from sidecar.scheduler.generate import wait_and_bring_up
    from sidecar.scheduler.images import prepare
    from sidecar.scheduler.scheduler import Request, Scheduler, run

    home = b.params.home
    path = resolve_model(MODEL, home)
    server = ServerProcess(MODEL, home, log_dir=log_dir, extra={"max_num_seqs": 4, "max_num_batched_tokens": 256})
    tmp = tempfile.TemporaryDirectory(prefix="bench-images-")
    worker = None
    try:
        server.start()
        worker = RemoteWorker(server.url)
        wait_and_bring_up(worker, lambda _: None, max_blocks=256)
        info = worker.info()
        sched = Scheduler(num_blocks=info["num_blocks"], block_size=info["block_size"], max_num_batched_tokens=256)
        step = (lambda so: worker.call("execute_model", scheduler_output=so))

        def ttft(rid: str, text: str, img: Path, max_tokens: int = 1) -> tuple[float, float]:
            """(time to first token, end to end) of one request alone."""
            ids, features = prepare(path, text, [img])
            sched.add_request(Request(rid, ids, {"temperature": 0.0}, max_tokens=max_tokens, ignore_eos=True,
                                      mm_features=features))
            first: list[float] = []
            t0 = time.perf_counter()
            run(sched, step, on_event=lambda e: first.append(time.perf_counter()) if not first else None)
            return first[0] - t0, time.perf_counter() - t0

        pics = [_png(Path(tmp.name), s) for s in range(6)]
        ttft("warm", "Warm up.", pics[0])
        firsts, repeats = [], []
        for i, img in enumerate(pics[1:]):
            firsts.append(ttft(f"first{i}", "Describe the sea.", img)[0])
            repeats.append(ttft(f"again{i}", "What colour is it?", img)[0])
        first, repeat = statistics.median(firsts), statistics.median(repeats)
        # end to end: mlx-vlm's generate in this process against one request through the server
        vlm, proc = load_model(path), load_processor(path)
        prompt = "<|im_start|>user\nTell a story.<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n<|im_start|>assistant\n"
        img = Image.open(_png(Path(tmp.name), 99)).convert("RGB")
        generate(vlm, proc, prompt, image=[img], max_tokens=4, temperature=0.0, verbose=False)  # warm
        t0 = time.perf_counter()
        res = generate(vlm, proc, prompt, image=[img], max_tokens=32, temperature=0.0, verbose=False)
        mlx_vlm_s = time.perf_counter() - t0
        n = int(res.generation_tokens)
        _, sidecar_s = ttft("e2e", "Tell a story.", _png(Path(tmp.name), 98), max_tokens=n)
        b.results.update(image_ttft_first_ms=first * 1e3, image_ttft_repeat_ms=repeat * 1e3,
                         image_ttft_repeat_ratio=repeat / first, image_e2e_tokens=n,
                         image_e2e_vs_mlx_vlm=mlx_vlm_s / sidecar_s)
        b.notes.append(f"images ({MODEL}): repeated-image TTFT {repeat * 1e3:.1f} ms vs first {first * 1e3:.1f} ms "
                       f"({repeat / first:.2f}x; goal <= 0.2x on models whose vision tower dominates a prefill); "
                       f"end to end {n} tokens: {mlx_vlm_s / sidecar_s:.2f}x mlx-vlm's generate (goal >= 0.9)")
    finally:
        if worker is not None:
            worker.close()
        server.stop()
        tmp.cleanup()
