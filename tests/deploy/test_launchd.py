"""deploy/launchd: the plist template and the install/uninstall scripts, checked against the real CLI."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest

from tests.deploy.deployfiles import (INSTALL, PLACEHOLDER, PLIST, SHUTDOWN_TIMEOUT, UNINSTALL, load_plist, parse_serve,
                                     run_sh, serve_flags, split_dry_run, unknown_flags)


def test_flag_check_rejects_made_up_flags() -> None:
    flags = serve_flags()
    assert {"--model", "--port", "--auth-token-file", "--preload", "--log-format", "--home"} <= flags
    assert "--auth-token" not in flags  # secrets never on argv
    argv = ["serve", "--model", "m", "--port=1", "--made-up-flag", "--preload", "--log-formatt", "json"]
    assert unknown_flags(argv) == ["--made-up-flag", "--log-formatt"]


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
