"""`python -m bench [--quick] [--only STAGES] [--scale-out] ...` (`make bench ARGS=...`)."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description="benchmark the sidecar against mlx-lm side by side")
    parser.add_argument("--model", default="builtin:small")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", dest="json_path", default="bench-results/bench.json")
    parser.add_argument("--plot", dest="plot_path", default="bench-results/throughput.png")
    parser.add_argument("--home", default=None)
    parser.add_argument("--only", default=None, metavar="STAGES",
                        help='a comma-separated subset of the stages, e.g. "tiny single stream,long context"')
    parser.add_argument("--scale-out", action="store_true",
                        help="only the scale-out scenario: 1 rank vs TP=2 / PP=2 over loopback")
    parser.add_argument("--data-parallel", action="store_true",
                        help="only vLLM data parallel: DP=2 over two sidecars vs DP=1 (needs .venv-vllm)")
    parser.add_argument("--recovery", action="store_true",
                        help="only the sidecar-restart recovery: /healthz to first token vs a cold prefill")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if argv is None:  # the command line itself, not a caller's argv
        from bench import blas

        blas.reexec("bundled")  # MLX_SIDECAR_BLAS overrides; the servers the bench starts inherit it
    if args.scale_out:
        from bench.group import group_bench_cli

        return group_bench_cli(args.home, args.quick, args.json_path)
    if args.data_parallel:
        from bench.dp import dp_bench_cli

        return dp_bench_cli(args.home, args.quick, args.json_path)
    if args.recovery:
        from bench.recovery import recovery_bench_cli

        return recovery_bench_cli(args.home, args.quick, args.json_path)
    from bench.run import bench_cli

    return bench_cli(args)


if __name__ == "__main__":
    sys.exit(main())
