"""deploy/systemd: the unit's directives, its ExecStart as a real serve command, and systemd-analyze."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from sidecar.cli import build_parser, config_from_args
from sidecar.config import Config
from tests.deploy.deployfiles import SHUTDOWN_TIMEOUT, UNIT, unknown_flags


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """systemd unit syntax: sections, repeated keys kept in order, '#'/';' comments, '\\' continuations."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in re.sub(r"\\\n", " ", text).splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None and "=" in line, f"bad unit line: {raw!r}"
        key, value = (s.strip() for s in line.split("=", 1))
        current.setdefault(key, []).append(value)
    return sections


def seconds(value: str) -> float:
    units = {"": 1, "s": 1, "sec": 1, "min": 60, "m": 60, "ms": 0.001}
    total = 0.0
    for num, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value):
        total += float(num) * units[unit]
    return total


def test_systemd_unit_directives() -> None:
    unit = parse_unit(UNIT.read_text())
    svc = {k: v[-1] for k, v in unit["Service"].items()}
    expected = {
        "Restart": "on-failure", "KillSignal": "SIGTERM", "StateDirectory": "mlx-sidecar",
        "NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
        "PrivateDevices": "yes", "LockPersonality": "yes", "ProtectKernelTunables": "yes",
        "ProtectKernelModules": "yes", "ProtectControlGroups": "yes", "RestrictSUIDSGID": "yes",
        "RestrictAddressFamilies": "AF_INET AF_INET6 AF_UNIX", "CapabilityBoundingSet": "",
    }
    assert {k: svc.get(k) for k in expected} == expected
    assert svc["Type"] in ("simple", "exec")
    assert svc.get("DynamicUser") == "yes" or svc.get("User") not in (None, "", "root")
    assert seconds(svc["RestartSec"]) >= 1
    assert seconds(svc["TimeoutStopSec"]) > SHUTDOWN_TIMEOUT
    env = dict(e.split("=", 1) for e in unit["Service"]["Environment"])
    assert env["MLX_SIDECAR_HOME"] == "/var/lib/" + svc["StateDirectory"] == svc["WorkingDirectory"]
    names = {f"MLX_SIDECAR_{f.name.upper()}" for f in fields(Config)}
    assert sorted(k for k in env if k.startswith("MLX_SIDECAR_") and k not in names) == []
    assert "MLX_SIDECAR_AUTH_TOKEN" not in env  # the token is a credential, not an environment value
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]


def test_systemd_exec_start_is_a_valid_serve_command(monkeypatch) -> None:
    unit = parse_unit(UNIT.read_text())["Service"]
    (exec_start,) = unit["ExecStart"]
    argv = shlex.split(exec_start)
    assert argv[0] == "/opt/mlx-sidecar/.venv/bin/mlx-sidecar" and argv[1] == "serve"
    assert unknown_flags(argv) == []
    # the unit's Environment= values go through the same Config parsing as on the real machine
    for key in list(os.environ):
        if key.startswith("MLX_SIDECAR_"):
            monkeypatch.delenv(key)
    env = dict(e.split("=", 1) for e in unit["Environment"])
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    cfg = config_from_args(build_parser().parse_args(argv[1:]))
    assert cfg.preload and cfg.log_format == "json" and cfg.host == "127.0.0.1" and cfg.port == 8000
    assert cfg.home == "/var/lib/mlx-sidecar"
    cred_id, _, cred_path = unit["LoadCredential"][0].partition(":")
    assert cfg.auth_token_file == f"${{CREDENTIALS_DIRECTORY}}/{cred_id}" and cred_path.startswith("/etc/")


def systemd_analyze() -> str:
    path = shutil.which("systemd-analyze")
    if path is None and sys.platform.startswith("linux"):
        pytest.fail("systemd-analyze is not installed: `make test` installs it (scripts/ensure-prometheus.sh)")
    if path is None:
        pytest.skip("systemd-analyze: Linux only; the static checks still ran")
    return path


def analyze(tmp_path: Path, text: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run systemd-analyze on a copy of the unit whose ExecStart binary exists (verify checks it)."""
    stub = tmp_path / "mlx-sidecar"
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    unit = tmp_path / "mlx-sidecar.service"
    unit.write_text(text.replace("/opt/mlx-sidecar/.venv/bin/mlx-sidecar", str(stub)))
    return subprocess.run([systemd_analyze(), *args, str(unit)], capture_output=True, text=True, timeout=60)


def unit_complaints(r: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in (r.stdout + r.stderr).splitlines() if "mlx-sidecar" in line]


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    text = UNIT.read_text()
    r = analyze(tmp_path, text, "verify", "--man=no")
    assert r.returncode == 0 and unit_complaints(r) == [], r.stdout + r.stderr
    # negative control: a bad value is reported (verify only warns, hence the output check)
    bad = analyze(tmp_path, text.replace("Restart=on-failure", "Restart=sometimes"), "verify", "--man=no")
    assert any("sometimes" in line for line in unit_complaints(bad)), bad.stdout + bad.stderr


def test_systemd_analyze_security_exposure(tmp_path: Path) -> None:
    r = analyze(tmp_path, UNIT.read_text(), "security", "--offline=yes", "--no-pager")
    match = re.search(r"Overall exposure level for mlx-sidecar\.service: ([0-9.]+)", r.stdout)
    assert match, r.stdout + r.stderr
    assert float(match.group(1)) <= 2.5, r.stdout
