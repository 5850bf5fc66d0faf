"""`mlx-sidecar embed`: pooling requests through the reference scheduler over RemoteWorker.

Each text is tokenised with the model's tokenizer, sent as a pooling request (docs/protocol.md,
Pooling) and its result printed as one JSON line: `{"text", "embedding"}` (or `"scores"` for
classify, `"embeddings"` per token for token_embed). A fresh worker is brought up to `ready` first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from sidecar.client.remote import RemoteError, RemoteWorker
from sidecar.scheduler.generate import load_tokenizer, wait_and_bring_up
from sidecar.scheduler.scheduler import Request, Scheduler, prefix_caching_offered, run

_KEYS = {"embed": "embedding", "classify": "scores", "token_embed": "embeddings", "token_classify": "scores"}


def add_embed_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("embed", help="embed (or classify) texts on a running sidecar with a pooling model")
    p.add_argument("texts", nargs="+")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--task", choices=list(_KEYS), default="embed")
    p.add_argument("--pooling-type", choices=["LAST", "MEAN", "CLS", "ALL"], default=None,
                   help="default: the model's (its sentence-transformers config, else LAST)")
    p.add_argument("--dimensions", type=int, default=None, help="Matryoshka: keep the first N values, re-normalised")
    p.add_argument("--activation", action=argparse.BooleanOptionalAction, default=True,
                   help="normalise embeddings / sigmoid-softmax scores (default on)")
    p.add_argument("--auth-token-file", default=None)
    p.add_argument("--model", default=None, help="tokenizer source (default: the model the server reports)")


def embed_cli(args: argparse.Namespace) -> int:
    token = (Path(args.auth_token_file).read_text().strip() if args.auth_token_file
             else os.environ.get("MLX_SIDECAR_AUTH_TOKEN", "").strip() or None)
    worker = RemoteWorker(args.url, token=token)
    try:
        wait_and_bring_up(worker, lambda line: print(f"mlx-sidecar embed: {line}", file=sys.stderr, flush=True))
        info, model = worker.info(), worker.get_model()
        tok = load_tokenizer(args.model or model["path"])
        sched = Scheduler(num_blocks=info["num_blocks"], block_size=info["block_size"],
                          max_model_len=info.get("max_model_len") or 0,
                          enable_prefix_caching=prefix_caching_offered(info.get("kv_cache_spec")))
        params = {"task": args.task, "pooling_type": args.pooling_type, "dimensions": args.dimensions,
                  "use_activation": args.activation}
        for i, text in enumerate(args.texts):
            sched.add_request(Request(f"embed-{i}", tok.encode(text).ids, {}, max_tokens=1, pooling_params=params))
        done = run(sched, lambda so: worker.call("execute_model", scheduler_output=so))
        for i, text in enumerate(args.texts):
            print(json.dumps({"text": text, _KEYS[args.task]: done[f"embed-{i}"].pooled}))
        return 0
    except (RemoteError, OSError, ValueError) as e:
        print(f"mlx-sidecar embed: {e}", file=sys.stderr)
        return 1
    finally:
        worker.close()
