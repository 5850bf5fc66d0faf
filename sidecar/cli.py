"""`mlx-sidecar serve | generate | embed | model-dir`: every Config field is a `serve` flag (--field-name)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from typing import Any, Sequence

from sidecar.config import Config, ConfigError, from_env

_HELP = {
    "model": "builtin:tiny | builtin:tiny-qwen3 | builtin:small | builtin:smollm2 (real, 4-bit) | path to an mlx-lm model directory",
    "kv_dtype": "KV cache dtype: auto (the model's), float16, bfloat16, float32, or 8bit / 4bit (quantised as "
                "mlx-lm's QuantizedKVCache, group size 64)",
    "runner": "auto (pooling requests where the model directory declares an embedding or classification model), "
              "generate, or pooling (any decoder model also embeds: vLLM's --runner pooling --convert embed)",
    "device": "auto (GPU when Metal/CUDA is available), gpu, cpu",
    "uds": "serve on this Unix socket (mode 0600) instead of TCP",
    "auth_token_file": "file holding the bearer token required on /rpc/* (or MLX_SIDECAR_AUTH_TOKEN)",
    "allow_insecure": "allow a non-loopback bind without an auth token",
    "protect_metrics": "require the token on /metrics and /info too",
    "preload": "run init_device .. compile_or_warm_up_model at start-up, showing each stage; RPCs get 503 "
               "until it is done (then the scheduler may still re-drive it)",
    "lora_dir": "the only directory LoRA adapters may be loaded from",
    "kv_store_dir": "keep full KV blocks on disk here (a prefix cache that outlives memory and restarts; default off)",
    "kv_store_max_gb": "size bound of --kv-store-dir in GiB, least recently used blocks evicted (default 16)",
    "home": "where built-in models are generated (default: MLX_SIDECAR_HOME or the user cache dir)",
    "decode_ahead": "start the likely next decode step while the response travels (default on)",
    "tensor_parallel": "shard the model's heads over N ranks (mx.distributed; start every rank with mlx.launch)",
    "pipeline_parallel": "split the model's layers over N ranks (mx.distributed; start every rank with mlx.launch)",
    "distributed_backend": "mx.distributed backend: ring (TCP, default), jaccl (RDMA over Thunderbolt 5), mpi, any",
    "exit_on_rank_failure": "exit non-zero when a rank is lost, so launchd/systemd restart the group (default on)",
    "rank_timeout": "seconds a step's collectives may go unanswered before the rank counts as lost",
    "heartbeat_interval": "seconds between liveness pings while the group is idle",
    "speculative_method": "none (default) | ngram (prompt lookup) | draft_model: the worker proposes drafts",
    "num_speculative_tokens": "drafts per request per step (default 3)",
    "prompt_lookup_min": "ngram: shortest suffix matched (default 2)",
    "prompt_lookup_max": "ngram: longest suffix matched (default 5)",
    "speculative_verify_cost": "ngram: what verifying one draft token costs, relative to a decode step, when deciding whether drafting pays (default: measured on the model at the first step)",
    "draft_model": "draft model for speculative decoding (builtin:<name> or an mlx-lm directory, same tokenizer)",
    "max_live_requests": "requests the worker holds at once (default 1024; 400 past it)",
    "max_req_id_len": "longest req_id in characters (default 256)",
    "max_encoder_cache_bytes": "bytes of image encoder outputs held until the scheduler frees them (default 4 GiB; 400 past it)",
    "idle_timeout": "seconds a connection with no request in it stays open (default 5)",
    "read_timeout": "seconds a request may take to arrive whole, head and body (default 60; then 408)",
    "max_connections": "connections held at once (default 512; past it the longest idle one is closed)",
}


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    for f in fields(Config):
        if f.name == "auth_token":  # secrets come from a file or the environment, never argv
            continue
        flag = "--" + f.name.replace("_", "-")
        help_ = _HELP.get(f.name, "")
        if f.type == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_)
        else:
            kind = {"int": int, "float": float}.get(str(f.type), str)
            parser.add_argument(flag, type=kind, default=None, metavar=f.name.upper(), help=help_ or f"default {f.default!r}")


def config_from_args(args: argparse.Namespace) -> Config:
    overrides: dict[str, Any] = {
        f.name: getattr(args, f.name) for f in fields(Config) if getattr(args, f.name, None) is not None
    }
    return from_env().replace(**overrides)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlx-sidecar", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the worker over HTTP")
    add_config_flags(serve)

    gen = sub.add_parser("generate", help="drive a running sidecar with the reference scheduler")
    gen.add_argument("prompt")
    gen.add_argument("--url", default="http://127.0.0.1:8000")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--auth-token-file", default=None)
    gen.add_argument("--model", default=None, help="tokenizer source (default: the model the server reports)")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                     help="apply the model's chat template to the prompt (default: when the model has one)")
    gen.add_argument("--image", action="append", default=None, metavar="PATH",
                     help="an image to ask about (repeatable; a vision-language model and the vision extra, "
                          "make install-vision): the prompt is chat-templated with the images after it")
    gen.add_argument("--speculative", choices=["none", "ngram"], default="none",
                     help="ngram: speculative decoding with prompt-lookup drafts (the worker's proposer when the "
                          "server runs one, else proposed here); the output is the same, in fewer steps")
    gen.add_argument("--num-speculative-tokens", type=int, default=3)
    gen.add_argument("--pipeline", type=int, choices=[0, 1, 2], default=0,
                     help="two steps in flight (docs/protocol.md, pipelined steps) over 1 pipelined connection "
                          "or 2 connections; 0: one step at a time. Not with --speculative")
    gen.add_argument("--num-decode-steps", type=int, default=1, metavar="N",
                     help="decode up to N tokens per call once the prompt is in (docs/protocol.md, several decode "
                          "steps in one call): one round trip per N tokens")

    from sidecar.scheduler.embed import add_embed_parser

    add_embed_parser(sub)

    md = sub.add_parser("model-dir", help="print (or write with --dest) the model directory vLLM needs locally")
    md.add_argument("model", nargs="?", default="builtin:tiny")
    md.add_argument("--dest", default=None, help="write only config + tokenizer files here (no MLX needed for built-ins)")
    md.add_argument("--home", default=None)

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        try:
            cfg = config_from_args(args)
        except ConfigError as e:
            print(f"mlx-sidecar: {e}", file=sys.stderr)
            return 2
        if cfg.world_size > 1:
            from sidecar.distributed.serve import serve_group

            return serve_group(cfg)
        from sidecar.server.app import serve

        return serve(cfg)
    if args.command == "model-dir":
        from sidecar.models import ModelNotFound
        from sidecar.models.export import model_dir

        try:
            print(model_dir(args.model, args.home, args.dest))
        except ModelNotFound as e:
            print(f"mlx-sidecar: {e}", file=sys.stderr)
            return 2
        return 0
    if args.command == "embed":
        from sidecar.scheduler.embed import embed_cli

        return embed_cli(args)
    from sidecar.scheduler.generate import generate_cli

    return generate_cli(args)


if __name__ == "__main__":
    sys.exit(main())
