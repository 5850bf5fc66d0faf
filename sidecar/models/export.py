"""`mlx-sidecar model-dir`: the HF-style directory vLLM needs on its own host (config + tokenizer).

vLLM reads the model's config and tokenizer locally even though the weights stay in the sidecar.
Without `--dest` this prints the sidecar's own model directory (generating a built-in). With
`--dest DIR` it writes only the files vLLM reads into DIR; for built-ins these are generated
without MLX (deterministic: the same files the sidecar has), so it runs on the vLLM host too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from sidecar.models.builtin import BUILTIN_MODELS, builtin_files, resolve_model, train_tokenizer
from sidecar.models.store import BUILTIN_PREFIX, ModelNotFound
from sidecar.models.vlm_builtin import VLM_MODELS, vlm_files

VLLM_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja",
              # what vLLM's processor reads for a vision-language model
              "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json", "chat_template.json")


def model_dir(name: str, home: str | None = None, dest: str | None = None) -> Path:
    if dest is None:
        return resolve_model(name, home)
    out = Path(dest).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    builtin = name[len(BUILTIN_PREFIX):] if name.startswith(BUILTIN_PREFIX) else None
    files = (builtin_files(builtin) if builtin in BUILTIN_MODELS else
             vlm_files(builtin, train_tokenizer) if builtin in VLM_MODELS else None)
    if files is not None:
        for filename, content in files.items():
            (out / filename).parent.mkdir(exist_ok=True)  # sentence-transformers' 1_Pooling/
            (out / filename).write_text(json.dumps(content, indent=2) + "\n")
        return out.resolve()
    src = resolve_model(name, home)  # a local directory (or an unknown built-in: ModelNotFound)
    copied = [f for f in VLLM_FILES + _sentence_transformers(src) if (src / f).is_file()]
    if "config.json" not in copied:
        raise ModelNotFound(f"{src} has no config.json")
    for f in copied:
        (out / f).parent.mkdir(exist_ok=True)
        shutil.copyfile(src / f, out / f)
    return out.resolve()


def _sentence_transformers(src: Path) -> tuple[str, ...]:
    """An embedding model's sentence-transformers files: vLLM reads its pooling from them."""
    try:
        modules = json.loads((src / "modules.json").read_text())
        subdirs = [m["path"] + "/config.json" for m in modules if m.get("path")]
    except (OSError, ValueError, TypeError, KeyError):
        return ()
    return ("modules.json", "config_sentence_transformers.json", "sentence_bert_config.json", *subdirs)
