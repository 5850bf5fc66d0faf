"""deploy/: launchd plist + install scripts, systemd unit, Prometheus config/alerts, checked against the CLI."""

from __future__ import annotations

import argparse
import os
import plistlib
import re
import shlex
import shutil
import stat
import subprocess
import sys
from dataclasses import fields
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


# --- the CLI contract ------------------------------------------------------------------------


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


def test_flag_check_rejects_made_up_flags() -> None:
    flags = serve_flags()
    assert {"--model", "--port", "--auth-token-file", "--preload", "--log-format", "--home"} <= flags
    assert "--auth-token" not in flags  # secrets never on argv
    argv = ["serve", "--model", "m", "--port=1", "--made-up-flag", "--preload", "--log-formatt", "json"]
    assert unknown_flags(argv) == ["--made-up-flag", "--log-formatt"]


# --- launchd ---------------------------------------------------------------------------------


def load_plist(text: str | bytes) -> dict:
    data = text.encode() if isinstance(text, str) else text
    return plistlib.loads(data)


def test_plist_template_keys() -> None:
    p = load_plist(PLIST.read_bytes())
    assert p["Label"] == "com.mlx-sidecar" == PLIST.stem
    args = p["ProgramArguments"]
    assert args[:2] == ["__PROGRAM__", "serve"]
    pairs = dict(zip(args, args[1:]))
    assert pairs["--model"] == "__MODEL__" and pairs["--port"] == "__PORT__"
    assert pairs["--auth-token-file"] == "__TOKEN_FILE__" and pairs["--log-format"] == "json"
    assert "--preload" in args
    assert p["RunAtLoad"] is True
    assert p["KeepAlive"] == {"SuccessfulExit": False}
    assert p["ThrottleInterval"] >= 5
    assert p["ExitTimeOut"] > SHUTDOWN_TIMEOUT
    assert p["ProcessType"] == "Interactive"
    assert p["WorkingDirectory"] == "__HOME__"
    assert p["EnvironmentVariables"]["MLX_SIDECAR_HOME"] == "__HOME__"
    assert "PATH" in p["EnvironmentVariables"]
    assert p["StandardOutPath"].startswith("__LOG_DIR__/") and p["StandardErrorPath"].startswith("__LOG_DIR__/")
    assert p["StandardOutPath"] != p["StandardErrorPath"]
    assert p["SoftResourceLimits"]["NumberOfFiles"] >= 1024
    assert not [k for k in p["EnvironmentVariables"] if "TOKEN" in k]


def test_plist_flags_are_real_cli_flags() -> None:
    args = load_plist(PLIST.read_bytes())["ProgramArguments"]
    assert [a for a in args if a.startswith("--")], "no flags found: the check would be vacuous"
    assert unknown_flags(args) == []


def run_sh(script: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # `sh` is dash on Debian: this also keeps the scripts POSIX.
    return subprocess.run(["sh", str(script), *args], capture_output=True, text=True, env=env, timeout=60)


@pytest.fixture
def fake_program(tmp_path: Path) -> Path:
    prog = tmp_path / "venv bin" / "mlx-sidecar"  # a space in the path on purpose
    prog.parent.mkdir()
    prog.write_text("#!/bin/sh\nexit 0\n")
    prog.chmod(0o755)
    return prog


def split_dry_run(stdout: str) -> tuple[str, list[str]]:
    end = stdout.index("</plist>") + len("</plist>")
    return stdout[:end], [line for line in stdout[end:].splitlines() if line]


def test_scripts_are_executable() -> None:
    for script in (INSTALL, UNINSTALL):
        assert script.stat().st_mode & stat.S_IXUSR, f"{script} is not executable"
        assert script.read_text().startswith("#!/bin/sh\n")
        assert "set -eu" in script.read_text()


def test_install_dry_run_renders_a_valid_plist(tmp_path: Path, fake_program: Path, monkeypatch) -> None:
    home = tmp_path / "home"
    model = "/models/a&b <c> 'd'|\\e"  # XML- and sed-special characters survive rendering
    env = {**os.environ, "HOME": str(home)}
    r = run_sh(INSTALL, "--dry-run", "--program", str(fake_program), "--model", model, "--port", "8123", env=env)
    assert r.returncode == 0, r.stderr
    text, commands = split_dry_run(r.stdout)
    assert not PLACEHOLDER.search(text), PLACEHOLDER.findall(text)
    p = load_plist(text)
    args = p["ProgramArguments"]
    assert args[0] == str(fake_program)
    state = f"{home}/Library/Application Support/mlx-sidecar"
    cfg = parse_serve(args[1:], monkeypatch)
    assert (cfg.model, cfg.port, cfg.host) == (model, 8123, "127.0.0.1")
    assert cfg.auth_token_file == f"{state}/token" and cfg.preload and cfg.log_format == "json"
    assert p["WorkingDirectory"] == p["EnvironmentVariables"]["MLX_SIDECAR_HOME"] == state
    assert p["EnvironmentVariables"]["PATH"].startswith(f"{fake_program.parent}:")
    assert p["StandardErrorPath"].startswith(f"{home}/Library/Logs/mlx-sidecar/")
    uid = os.getuid()
    agent = f"{home}/Library/LaunchAgents/com.mlx-sidecar.plist"
    assert f"+ launchctl bootstrap gui/{uid} {agent}" in commands
    assert f"+ launchctl enable gui/{uid}/com.mlx-sidecar" in commands
    assert commands.index(f"+ launchctl bootout gui/{uid}/com.mlx-sidecar") < commands.index(
        f"+ launchctl bootstrap gui/{uid} {agent}"
    )
    assert any(c.startswith("+ generate-token ") for c in commands)  # no token file yet
    assert not home.exists(), "--dry-run must not touch the file system"


def test_install_dry_run_system_domain(tmp_path: Path, fake_program: Path) -> None:
    token = tmp_path / "token"
    r = run_sh(INSTALL, "--dry-run", "--system", "--user", "_mlx", "--program", str(fake_program),
               "--token-file", str(token))
    assert r.returncode == 0, r.stderr
    text, commands = split_dry_run(r.stdout)
    p = load_plist(text)
    assert p["UserName"] == "_mlx"
    assert p["ProgramArguments"][p["ProgramArguments"].index("--auth-token-file") + 1] == str(token)
    assert "+ launchctl bootstrap system /Library/LaunchDaemons/com.mlx-sidecar.plist" in commands
    assert not any("generate-token" in c for c in commands)  # an explicit token file is used as is
    assert any(c.startswith("+ install -m 0644 -o root -g wheel ") for c in commands)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--port", "80a"], "--port must be a number"),
        (["--port", "70000"], "1..65535"),
        (["--program", "relative/mlx-sidecar"], "absolute path"),
        (["--token-file", "token"], "absolute path"),
        (["--bogus"], "unknown option"),
        (["--model"], "needs a value"),
        (["--system"], "must not run as root"),  # no --user and (in the test) no SUDO_USER
    ],
)
def test_install_rejects_bad_options(args: list[str], message: str, fake_program: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SUDO_USER"}
    r = run_sh(INSTALL, "--dry-run", "--program", str(fake_program), *args, env=env)
    assert r.returncode != 0 and message in r.stderr, (r.returncode, r.stderr)
    assert "<plist" not in r.stdout


def test_install_and_uninstall_with_a_fake_launchctl(tmp_path: Path, fake_program: Path, monkeypatch) -> None:
    """The real (non-dry-run) path: files written, token generated 0600 once, launchctl driven."""
    bin_dir, home, log = tmp_path / "bin", tmp_path / "home", tmp_path / "launchctl.log"
    bin_dir.mkdir()
    fake = bin_dir / "launchctl"
    fake.write_text(f'#!/bin/sh\necho "$*" >> "{log}"\n[ "$1" != bootout ] || exit 3  # "not loaded"\n')
    fake.chmod(0o755)
    env = {**os.environ, "HOME": str(home), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    args = ["--program", str(fake_program), "--port", "8124"]

    r = run_sh(INSTALL, *args, env=env)
    assert r.returncode == 0, r.stderr
    uid, target = os.getuid(), f"gui/{os.getuid()}/com.mlx-sidecar"
    agent = home / "Library/LaunchAgents/com.mlx-sidecar.plist"
    assert log.read_text().splitlines() == [
        f"bootout {target}", f"enable {target}", f"bootstrap gui/{uid} {agent}", f"kickstart {target}"
    ]
    p = load_plist(agent.read_bytes())
    token = Path(p["ProgramArguments"][p["ProgramArguments"].index("--auth-token-file") + 1])
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert stat.S_IMODE(token.parent.stat().st_mode) == 0o700
    secret = token.read_text().strip()
    assert re.fullmatch(r"[0-9a-f]{64}", secret)
    assert Path(p["StandardErrorPath"]).parent.is_dir()
    assert parse_serve(p["ProgramArguments"][1:], monkeypatch).token() == secret

    assert run_sh(INSTALL, *args, env=env).returncode == 0  # re-install keeps the token
    assert token.read_text().strip() == secret

    log.unlink()
    r = run_sh(UNINSTALL, env=env)
    assert r.returncode == 0, r.stderr
    assert log.read_text().splitlines() == [f"bootout {target}"]
    assert not agent.exists() and token.exists()  # state kept without --purge


def test_uninstall_dry_run(tmp_path: Path) -> None:
    env = {**os.environ, "HOME": str(tmp_path)}
    r = run_sh(UNINSTALL, "--dry-run", "--purge", env=env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"+ launchctl bootout gui/{os.getuid()}/com.mlx-sidecar"
    assert f"+ rm -f {tmp_path}/Library/LaunchAgents/com.mlx-sidecar.plist" in lines
    assert any(line.startswith("+ rm -rf ") and "Application Support/mlx-sidecar" in line for line in lines)
    r = run_sh(UNINSTALL, "--dry-run", "--system")
    assert r.stdout.splitlines()[0] == "+ launchctl bootout system/com.mlx-sidecar"
    assert "rm -rf" not in r.stdout
    assert run_sh(UNINSTALL, "--nope").returncode != 0


# --- systemd ---------------------------------------------------------------------------------


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


# --- Prometheus ------------------------------------------------------------------------------


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


@pytest.mark.parametrize(
    "args",
    [("check", "config", "prometheus.yml"), ("check", "config", "prometheus-replicas.yml"),
     ("check", "rules", "alerts.yml"), ("test", "rules", "alerts_test.yml")],
    ids=" ".join,
)
def test_promtool(args: tuple[str, ...]) -> None:
    r = run_promtool(*args)
    assert r.returncode == 0, r.stdout + r.stderr


def test_scrape_config_targets_the_sidecar() -> None:
    cfg = yaml.safe_load((PROM / "prometheus.yml").read_text())
    (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "mlx-sidecar"]
    cli = Config()
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == [f"{cli.host}:{cli.port}"]
    assert cfg["rule_files"] == ["alerts.yml"]
    assert "credentials_file" in (PROM / "prometheus.yml").read_text()  # the commented bearer option


def alert_rules() -> list[dict]:
    groups = yaml.safe_load((PROM / "alerts.yml").read_text())["groups"]
    return [r for g in groups for r in g["rules"] if "alert" in r]


def test_alerts_cover_the_design_and_are_annotated() -> None:
    rules = {r["alert"]: r for r in alert_rules()}
    exprs = " ".join(r["expr"] for r in rules.values())
    for needle in ("up{", "mlx_worker_healthy == 0", 'mlx_worker_state{state="ready"} == 0',
                   'mlx_worker_state{state="sleeping"} == 1', "mlx_worker_kv_cache_usage_ratio > 0.95",
                   "histogram_quantile(0.99", "mlx_worker_step_duration_seconds_bucket[5m]",
                   "mlx_worker_memory_active_bytes / mlx_worker_memory_limit_bytes > 0.9"):
        assert needle in exprs, needle
    for name, rule in rules.items():
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
        assert "for" in rule, name


def test_alert_tests_cover_firing_and_not_firing() -> None:
    tests = yaml.safe_load((PROM / "alerts_test.yml").read_text())["tests"]
    cases = [c for t in tests for c in t["alert_rule_test"]]
    for rule in alert_rules():
        mine = [c for c in cases if c["alertname"] == rule["alert"]]
        assert any(c["exp_alerts"] for c in mine), f"{rule['alert']}: no firing case"
        assert any(not c["exp_alerts"] for c in mine), f"{rule['alert']}: no not-firing case"


@pytest.mark.parametrize(
    "rules",
    [
        "groups:\n  - name: broken\n    rules:\n      - alert: Bad\n        expr: up ==\n",
        "groups:\n  - name: broken\n    rules:\n      - alert: Bad\n        expr: up == 0\n        for: soon\n",
        "groups:\n  - name: broken\n    rules:\n      - alert: Bad\n        expr: up == 0\n"
        "        annotations:\n          summary: '{{ $labels.instance '\n",
    ],
    ids=["bad-promql", "bad-duration", "bad-template"],
)
def test_promtool_rejects_broken_rules(rules: str, tmp_path: Path) -> None:
    (tmp_path / "broken.yml").write_text(rules)
    r = run_promtool("check", "rules", "broken.yml", cwd=tmp_path)
    assert r.returncode != 0, r.stdout + r.stderr


@pytest.mark.parametrize(
    "old, new",
    [
        ("unless on (job, instance)\n          mlx_worker_state{state=\"sleeping\"} == 1", ""),  # alerts on sleep
        ("mlx_worker_kv_cache_usage_ratio > 0.95", "mlx_worker_kv_cache_usage_ratio >= 0.95"),
        ("and mlx_worker_memory_limit_bytes > 0", ""),  # a limit of 0 (ratio +Inf) would alert
        ("\n          ) > 2\n", "\n          ) > 5\n"),  # p99 threshold
        ('up{job="mlx-sidecar"} == 0', "up == 0"),  # other jobs' targets would alert
        ('up{job="mlx-sidecar-replicas"} == 0', "up == 0"),  # the single-sidecar job would alert as a replica
    ],
    ids=["no-sleep-exclusion", "kv-threshold", "no-zero-limit-guard", "p99-threshold", "down-any-job",
         "replica-any-job"],
)
def test_alert_unit_tests_catch_regressions(old: str, new: str, tmp_path: Path) -> None:
    """Mutants of alerts.yml must fail alerts_test.yml: the unit tests really discriminate."""
    original = (PROM / "alerts.yml").read_text()
    assert old in original, f"mutation target vanished: {old!r}"
    mutant = original.replace(old, new)
    (tmp_path / "alerts.yml").write_text(mutant)
    shutil.copy(PROM / "alerts_test.yml", tmp_path)
    assert run_promtool("check", "rules", "alerts.yml", cwd=tmp_path).returncode == 0  # still valid rules
    r = run_promtool("test", "rules", "alerts_test.yml", cwd=tmp_path)
    assert r.returncode != 0, f"alerts_test.yml did not notice {old!r} -> {new!r}"
