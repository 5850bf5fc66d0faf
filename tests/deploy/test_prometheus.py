"""deploy/prometheus: the scrape configs and alert rules, with promtool and mutants of the rules."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from sidecar.config import Config
from tests.deploy.deployfiles import PROM, alert_rules, run_promtool


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
