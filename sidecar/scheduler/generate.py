"""`mlx-sidecar generate`: the reference scheduler over RemoteWorker, streaming text to stdout.

It brings a fresh worker up to `ready` itself (the calls a scheduler makes at start-up), so
`make serve` followed by one `generate` shows the whole loop working. A server still bringing
itself up (`serve --preload`) is waited for instead, never raced.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path
from typing import Any, Callable

from sidecar.client.remote import RemoteError, RemoteWorker
from sidecar.client.pipeline import Pipeline
from sidecar.scheduler.chat import prompt_ids
from sidecar.scheduler.pipelined import run_pipelined
from sidecar.scheduler.scheduler import Event, Request, Scheduler, prefix_caching_offered, run
from sidecar.vllm.recovery import Recovering, SidecarLost


def wait_and_bring_up(worker: RemoteWorker, say: Callable[[str], None], max_blocks: int = 8192) -> None:
    """Wait out a server's own preload (showing each stage), else drive the lifecycle ourselves."""
    def waiting(what: str) -> None:
        say(f"waiting for the server ({what})")

    body = worker.wait_while_starting(waiting)
    if body.get("ready"):
        return
    try:
        bring_up(worker, body.get("state", ""), max_blocks)
    except RemoteError as e:
        if not (e.status == 503 and e.message.startswith("starting:")):
            raise
        worker.wait_while_starting(waiting)


def bring_up(worker: RemoteWorker, state: str, max_blocks: int = 8192) -> None:
    """Drive the lifecycle from wherever the worker is to `ready`, as a scheduler does at start-up."""
    if state in ("created", "shut_down", ""):
        worker.init_device()
        state = "device_ready"
    if state == "device_ready":
        worker.load_model()
        state = "model_loaded"
    if state == "model_loaded":
        free = worker.determine_available_memory()
        worker.initialize_cache(num_gpu_blocks=max(1, min(free // worker.get_cache_block_size_bytes(), max_blocks)))
        state = "cache_ready"
    if state == "cache_ready":
        worker.compile_or_warm_up_model()
    if state == "sleeping":
        worker.wake_up()


def load_tokenizer(model_path: str) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(model_path) / "tokenizer.json"))


class StreamPrinter:
    """Incremental detokenisation: print only the new, complete text."""

    def __init__(self, decode: Callable[[list[int]], str], out: Any = sys.stdout):
        self.decode, self.out = decode, out
        self.tokens: list[int] = []
        self.printed = ""

    def __call__(self, event: Event) -> None:
        self.tokens += event.new_token_ids
        text = self.decode(self.tokens)
        if text.endswith("\ufffd") and not event.finished:
            return  # half a multi-byte character: wait for the rest
        self.out.write(text[len(self.printed):])
        self.out.flush()
        self.printed = text


def draft_source(args: argparse.Namespace, info: dict, worker: RemoteWorker,
                 sched: Scheduler) -> Callable[[], dict | None] | None:
    """--speculative ngram: the worker's own drafts when it runs a proposer (serve
    --speculative-method), else prompt lookup here in the scheduler; either way the worker verifies."""
    if args.speculative == "none":
        return None
    if info.get("speculative_method", "none") != "none":
        return worker.take_draft_token_ids
    return lambda: sched.propose_ngram(args.num_speculative_tokens)


def generate_cli(args: argparse.Namespace) -> int:
    token = (Path(args.auth_token_file).read_text().strip() if args.auth_token_file
             else os.environ.get("MLX_SIDECAR_AUTH_TOKEN", "").strip() or None)
    worker = RemoteWorker(args.url, token=token, pin_instance=True)

    def say(line: str) -> None:
        print(f"mlx-sidecar generate: {line}", file=sys.stderr, flush=True)

    try:
        wait_and_bring_up(worker, say)
        info = worker.info()
        model = worker.get_model()
        tok = load_tokenizer(args.model or model["path"])
        sched = Scheduler(num_blocks=info["num_blocks"], block_size=info["block_size"],
                          eos_token_ids=model["eos_token_ids"], max_model_len=info.get("max_model_len") or 0,
                          enable_prefix_caching=prefix_caching_offered(info.get("kv_cache_spec")),
                          kv_store_lookup=worker.kv_store_lookup if (info.get("kv_store") or {}).get("refused", 1) is None
                          else None,  # a server with a usable --kv-store-dir: prompts load and save through it
                          num_decode_steps=getattr(args, "num_decode_steps", 1))
        sampling: dict = {"temperature": args.temperature}
        if args.seed is not None:
            sampling["seed"] = args.seed
        features: list[dict] = []
        if getattr(args, "image", None):  # mlx-vlm's processor expands the prompt and prepares the images
            from sidecar.scheduler.images import prepare

            prompt, features = prepare(args.model or model["path"], args.prompt, args.image)
        else:
            prompt = prompt_ids(tok, args.model or model["path"], args.prompt, getattr(args, "chat", None))
        sched.add_request(Request("generate-0", prompt, sampling, max_tokens=args.max_tokens, mm_features=features))
        printer = StreamPrinter(lambda ids: tok.decode(ids, skip_special_tokens=True))
        if getattr(args, "pipeline", 0) and args.speculative == "none":
            pipe = Pipeline(args.url, token=token, connections=args.pipeline)
            try:
                run_pipelined(sched, lambda so: pipe.submit("execute_model", scheduler_output=so), pipe.collect,
                              on_event=printer)
            finally:
                pipe.close()
        else:
            # A server restarted under the run (a crash, a service manager) is waited for and
            # brought back to this run's state (sidecar/vllm/recovery.py): the text is unchanged.
            rec = Recovering(worker, where=f"MLX sidecar at {args.url}", block_size=info["block_size"],
                             recover_timeout=float(os.environ.get("MLX_SIDECAR_RECOVER_TIMEOUT", 120)),
                             budget=sched.max_num_batched_tokens, max_seqs=sched.max_num_seqs,
                             prefix_cache=sched.blocks.enable_prefix_caching, bring_up=lambda w: wait_and_bring_up(w, say))
            rec.adopt(info["num_blocks"])
            # Numbered steps (a lost reply is resent, never run twice); the first one unnumbered: it
            # ends whatever numbered sequence an earlier client left on the server.
            steps = itertools.chain([None], itertools.count(1))
            run(sched, lambda so: rec.call("execute_model", scheduler_output=so, step_id=next(steps)),
                on_event=printer, take_draft_token_ids=draft_source(args, info, worker, sched))
        sys.stdout.write("\n")
        if args.speculative != "none":
            rate = sched.num_accepted_tokens / sched.num_draft_tokens if sched.num_draft_tokens else 0.0
            print(f"speculative: {sched.num_accepted_tokens}/{sched.num_draft_tokens} drafts accepted ({rate:.0%})",
                  file=sys.stderr)
        return 0
    except (RemoteError, OSError, ValueError, SidecarLost) as e:  # ValueError: --chat without a template, a bad template
        print(f"mlx-sidecar generate: {e}", file=sys.stderr)
        return 1
    finally:
        worker.close()
