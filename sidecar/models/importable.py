"""Refuse, before mlx-lm loads anything, a model whose mlx-lm module cannot even be imported here.

Some mlx-lm modules need a package of their own: `olmo` imports `hf_olmo` (ai2-olmo) and calls
`sys.exit` when it is missing, after printing to stdout. Importing the module first, quietly and
catching that exit, turns it into a 400 naming the module and the missing package instead of a
bare "cannot be loaded" (or a worker that exits).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
from pathlib import Path

from sidecar.kv.spec import UnsupportedModel

# What a module that exits on import (rather than raising ImportError) needs.
_NEEDS = {"olmo": "ai2-olmo (hf_olmo)"}


def check_importable(path: Path) -> None:
    """Raises UnsupportedModel (field "model") if the model type's mlx-lm module fails to import."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
        model_type = str(config["model_type"])
    except (OSError, ValueError, KeyError, TypeError):
        return  # not readable here: mlx-lm's own load reports it
    from mlx_lm.utils import MODEL_REMAPPING

    name = MODEL_REMAPPING.get(model_type, model_type)
    if not name.replace("_", "").replace("-", "").isalnum():
        return  # not a module name: mlx-lm reports the unknown type
    missing = None
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            importlib.import_module(f"mlx_lm.models.{name}")
        except SystemExit:
            missing = _NEEDS.get(name, "a package that is not installed")
        except ModuleNotFoundError as e:
            if e.name == f"mlx_lm.models.{name}":
                return  # an unknown model type: mlx-lm's own load reports it
            missing = e.name or "a package that is not installed"
        except ImportError as e:
            missing = e.name or "a package that is not installed"
    if missing:
        raise UnsupportedModel(f"{name}: mlx-lm's {name} module cannot be imported here: it needs {missing}",
                               field="model")
