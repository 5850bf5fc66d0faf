"""deploy/ for a group of Macs (docs/scale-out.md): install.sh --rank renders one rank's plist whose
environment is what mlx.launch exports plus the group's shape, read back through the real Config."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from sidecar.config import from_env
from tests.deploy.deployfiles import (INSTALL, PROM, UNIT, alert_rules, load_plist, parse_serve, run_promtool, run_sh,
                                     split_dry_run)


def test_install_dry_run_renders_a_group_rank(tmp_path: Path, fake_program: Path, monkeypatch) -> None:
    hostfile = "/etc/mlx sidecar/hosts&<1>.json"  # spaces and XML-special characters survive
    env = {**os.environ, "HOME": str(tmp_path / "home")}
    r = run_sh(INSTALL, "--dry-run", "--program", str(fake_program), "--rank", "1", "--hostfile", hostfile,
               "--pipeline-parallel", "2", env=env)
    assert r.returncode == 0, r.stderr
    p = load_plist(split_dry_run(r.stdout)[0])
    e = p["EnvironmentVariables"]
    assert (e["MLX_RANK"], e["MLX_HOSTFILE"]) == ("1", hostfile)
    assert e["MLX_SIDECAR_HOME"].endswith("mlx-sidecar")  # the usual entries are kept
    flags = parse_serve(p["ProgramArguments"][1:], monkeypatch)  # (clears MLX_SIDECAR_* first)
    for key, value in e.items():
        if key.startswith("MLX_SIDECAR_") and key != "MLX_SIDECAR_HOME":
            monkeypatch.setenv(key, value)
    cfg = from_env(flags)
    assert (cfg.pipeline_parallel, cfg.tensor_parallel, cfg.distributed_backend, cfg.world_size) == (2, 1, "ring", 2)
    assert p["KeepAlive"] == {"SuccessfulExit": False}  # rank 0's exit 1 and a follower's 75 both restart


def test_install_without_group_options_has_no_group_environment(fake_program: Path, tmp_path: Path) -> None:
    r = run_sh(INSTALL, "--dry-run", "--program", str(fake_program), env={**os.environ, "HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    env = load_plist(split_dry_run(r.stdout)[0])["EnvironmentVariables"]
    assert not {"MLX_RANK", "MLX_HOSTFILE", "MLX_SIDECAR_TENSOR_PARALLEL"} & set(env)


@pytest.mark.parametrize("args, message", [
    (["--rank", "1", "--hostfile", "/h"], "needs --tensor-parallel N or --pipeline-parallel N"),
    (["--rank", "2", "--hostfile", "/h", "--tensor-parallel", "2"], "below the group size 2"),
    (["--rank", "x", "--hostfile", "/h", "--tensor-parallel", "2"], "--rank must be a number"),
    (["--rank", "0", "--hostfile", "hosts.json", "--tensor-parallel", "2"], "--hostfile must be an absolute path"),
    (["--rank", "0", "--hostfile", "/h", "--tensor-parallel", "2", "--pipeline-parallel", "2"], "cannot be combined"),
    (["--rank", "0", "--hostfile", "/h", "--tensor-parallel", "0"], ">= 1"),
    (["--rank", "0", "--hostfile", "/h", "--tensor-parallel", "2", "--backend", "tcp"], "--backend must be"),
    (["--rank", "0", "--hostfile", "/h", "--tensor-parallel", "2", "--backend", "jaccl"], "use mlx.launch"),
])
def test_install_rejects_bad_group_options(args: list[str], message: str, fake_program: Path) -> None:
    r = run_sh(INSTALL, "--dry-run", "--program", str(fake_program), *args)
    assert r.returncode != 0 and message in r.stderr, (r.returncode, r.stderr)
    assert "<plist" not in r.stdout


def test_systemd_unit_documents_a_group_rank() -> None:
    text = UNIT.read_text()
    for needle in ("MLX_RANK=", "MLX_HOSTFILE=", "MLX_SIDECAR_TENSOR_PARALLEL=", "Restart=on-failure"):
        assert needle in text, needle


def test_lost_rank_alerts_exist() -> None:
    rules = {r["alert"]: r for r in alert_rules()}
    assert rules["MlxSidecarRankLost"]["expr"].strip() == "mlx_worker_rank_up == 0"
    assert "mlx_worker_group_size" in rules["MlxSidecarGroupDown"]["expr"]
    assert all(rules[a]["labels"]["severity"] == "critical" for a in ("MlxSidecarRankLost", "MlxSidecarGroupDown"))


@pytest.mark.parametrize("old, new", [
    ("and on (job, instance)\n          max_over_time(mlx_worker_group_size[1h]) > 1", ""),  # any target down
    ("mlx_worker_rank_up == 0", "mlx_worker_rank_up == 1"),
])
def test_alert_tests_catch_lost_rank_regressions(old: str, new: str, tmp_path: Path) -> None:
    original = (PROM / "alerts.yml").read_text()
    assert old in original, f"mutation target vanished: {old!r}"
    (tmp_path / "alerts.yml").write_text(original.replace(old, new))
    shutil.copy(PROM / "alerts_test.yml", tmp_path)
    assert run_promtool("check", "rules", "alerts.yml", cwd=tmp_path).returncode == 0
    assert run_promtool("test", "rules", "alerts_test.yml", cwd=tmp_path).returncode != 0
