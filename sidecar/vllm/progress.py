"""Signs of life while the sidecar warms up: vLLM waits on one long RPC meanwhile.

Measuring the activation peak (`determine_available_memory`) and warming up run forwards at the
shape vLLM's `--max-num-batched-tokens` (one prefill of that many tokens) and `--max-num-seqs`
(one decode batch) set; on a slow device that takes minutes, and vLLM's own output is silent (or,
with a worker process, repeats "No available shared memory broadcast block found"). This logs
what is running, at which shape, every `every` seconds until it returns.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from typing import Iterator

# Under "vllm.": vLLM configures only its own loggers, so this is where its output shows.
log = logging.getLogger("vllm.mlx_sidecar")


@contextmanager
def heartbeat(what: str, every: float = 15.0) -> Iterator[None]:
    stop = threading.Event()
    t0 = time.monotonic()

    def beat() -> None:
        while not stop.wait(every):
            log.info("MLX sidecar: still %s (%.0f s)", what, time.monotonic() - t0)

    thread = threading.Thread(target=beat, name="sidecar-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
    log.info("MLX sidecar: done %s in %.1f s", what, time.monotonic() - t0)


def warm_up_shape(scheduler_config) -> str:
    return (f"a {scheduler_config.max_num_batched_tokens}-token prefill and a {scheduler_config.max_num_seqs}-sequence "
            "decode, the shape vLLM's --max-num-batched-tokens and --max-num-seqs set")
