"""The vLLM side runs on hosts without MLX: the wire types, the client and sidecar.vllm import with mlx blocked."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.server.serverproc import ROOT

_BLOCK = textwrap.dedent("""
    import sys

    class BlockMLX:
        def find_spec(self, name, path=None, target=None):
            if name == "mlx" or name.startswith("mlx.") or name.startswith("mlx_lm"):
                raise ImportError(f"blocked: {name}")

    sys.meta_path.insert(0, BlockMLX())
    for m in [m for m in sys.modules if m == "mlx" or m.startswith(("mlx.", "mlx_lm"))]:
        del sys.modules[m]
""")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _BLOCK + textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def test_wire_modules_import_without_mlx() -> None:
    r = _run("""
        import sidecar.wire.protocol, sidecar.client.remote, sidecar.vllm, sidecar.wire.sampling_params, sidecar.cli
        from sidecar.wire.protocol import SchedulerOutput
        out = SchedulerOutput.from_wire({"scheduled_new_reqs": [{"req_id": "a", "prompt_token_ids": [1, 2],
            "sampling_params": {"temperature": 0.5, "seed": 3}, "block_ids": [[0]]}],
            "num_scheduled_tokens": {"a": 2}, "total_num_scheduled_tokens": 2}, vocab_size=10, max_logprobs=5)
        assert out.scheduled_new_reqs[0].sampling_params.seed == 3
        # The vLLM host writes the model directory it needs without MLX.
        import tempfile
        from sidecar.models.export import model_dir
        out = model_dir("builtin:tiny", dest=tempfile.mkdtemp())
        assert (out / "tokenizer_config.json").is_file() and not (out / "model.safetensors").exists()
        assert not any(m == "mlx" or m.startswith("mlx.") for m in sys.modules)
        print("ok")
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_the_block_really_blocks_mlx() -> None:
    """Negative control: the same finder makes the MLX runner fail to import."""
    r = _run("import sidecar.engine.sampler")
    assert r.returncode != 0
    assert "blocked: mlx" in r.stderr
