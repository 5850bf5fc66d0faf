"""The deploy/ files and the checks the deploy tests share: the real CLI's serve flags and parser,
the launchd scripts run under `sh`, and promtool."""

from __future__ import annotations

import argparse
import os
import plistlib
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from sidecar.cli import build_parser, config_from_args
from sidecar.config import Config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
PLIST = DEPLOY / "launchd" / "com.mlx-sidecar.plist"
INSTALL = DEPLOY / "launchd" / "install.sh"
UNINSTALL = DEPLOY / "launchd" / "uninstall.sh"
UNIT = DEPLOY / "systemd" / "mlx-sidecar.service"
PROM = DEPLOY / "prometheus"
PLACEHOLDER = re.compile(r"__[A-Z][A-Z_]*__")
SHUTDOWN_TIMEOUT = Config().shutdown_timeout


def serve_flags() -> set[str]:
    """Every long option of `mlx-sidecar serve`, read from the real argparse parser."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {s for a in sub.choices["serve"]._actions for s in a.option_strings if s.startswith("--")}


def unknown_flags(argv: list[str]) -> list[str]:
    known = serve_flags()
    return [a.split("=", 1)[0] for a in argv if a.startswith("--") and a.split("=", 1)[0] not in known]


def parse_serve(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> Config:
    """Parse `serve ...` argv exactly as the CLI would, ignoring the caller's MLX_SIDECAR_* env."""
    for key in list(os.environ):
        if key.startswith("MLX_SIDECAR_"):
            monkeypatch.delenv(key)
    args = build_parser().parse_args(argv)
    assert args.command == "serve"
    return config_from_args(args)


def load_plist(text: str | bytes) -> dict:
    data = text.encode() if isinstance(text, str) else text
    return plistlib.loads(data)


def run_sh(script: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # `sh` is dash on Debian: this also keeps the scripts POSIX.
    return subprocess.run(["sh", str(script), *args], capture_output=True, text=True, env=env, timeout=60)


def split_dry_run(stdout: str) -> tuple[str, list[str]]:
    end = stdout.index("</plist>") + len("</plist>")
    return stdout[:end], [line for line in stdout[end:].splitlines() if line]


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(
            "promtool not found on PATH: CI must install Debian's `prometheus` package "
            "(apt-get install -y prometheus), which provides /usr/bin/promtool",
            pytrace=False,
        )
    return path


def run_promtool(*args: str, cwd: Path = PROM) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def alert_rules() -> list[dict]:
    groups = yaml.safe_load((PROM / "alerts.yml").read_text())["groups"]
    return [r for g in groups for r in g["rules"] if "alert" in r]
