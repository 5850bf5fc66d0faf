from __future__ import annotations

from dataclasses import fields

from sidecar.cli import build_parser, config_from_args, main
from sidecar.config import Config


def test_every_config_field_is_a_serve_flag_except_the_secret() -> None:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    flags = {opt for a in serve._actions for opt in a.option_strings}
    for f in fields(Config):
        assert (f"--{f.name.replace('_', '-')}" in flags) == (f.name != "auth_token"), f.name


def test_flags_map_onto_config(monkeypatch) -> None:
    import os

    for key in [k for k in os.environ if k.startswith("MLX_SIDECAR_")]:
        monkeypatch.delenv(key)
    args = build_parser().parse_args(["serve", "--port", "9100", "--block-size", "32", "--preload", "--model", "builtin:tiny-qwen3"])
    cfg = config_from_args(args)
    assert (cfg.port, cfg.block_size, cfg.preload, cfg.model) == (9100, 32, True, "builtin:tiny-qwen3")
    assert config_from_args(build_parser().parse_args(["serve"])) == Config()


def test_bad_flag_value_is_a_clean_error(capsys) -> None:
    assert main(["serve", "--block-size", "0"]) == 2
    assert "block_size" in capsys.readouterr().err


def test_scale_out_without_a_group_is_a_clean_error(monkeypatch, capsys) -> None:
    import logging

    for key in ("MLX_RANK", "MLX_HOSTFILE"):
        monkeypatch.delenv(key, raising=False)
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", list(root.handlers))  # serve configures logging: undone after
    monkeypatch.setattr(root, "level", root.level)
    assert main(["serve", "--tensor-parallel", "2", "--log-level", "error"]) == 2
    err = capsys.readouterr().err
    assert "MLX_HOSTFILE" in err and "mlx.launch" in err
