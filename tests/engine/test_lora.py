from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from sidecar.errors import ProtocolError
from sidecar.models import resolve_model
from tests.conftest import mlx_lm_greedy
from tests.driver import Driver

PROMPT = list(range(30, 52))


def make_adapter(home: str, dest: Path, seed: int, rank: int = 4) -> None:
    """An mlx-lm LoRA adapter for builtin:tiny, made with mlx-lm's own tuner, non-zero B."""
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model

    model = load_model(resolve_model("builtin:tiny", home))[0]
    params = {"rank": rank, "scale": 10.0, "dropout": 0.0}
    linear_to_lora_layers(model, 2, params)
    rng = np.random.default_rng(seed)
    lora = {k: mx.array(rng.normal(0, 0.05, v.shape).astype(np.float32))
            for k, v in tree_flatten(model.parameters()) if k.endswith((".lora_a", ".lora_b"))}
    dest.mkdir(parents=True)
    mx.save_safetensors(str(dest / "adapters.safetensors"), lora)
    (dest / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": params}))


@pytest.fixture
def lora_dir(home: str, tmp_path: Path) -> Path:
    make_adapter(home, tmp_path / "loras" / "one", seed=1)
    make_adapter(home, tmp_path / "loras" / "two", seed=2)
    return tmp_path / "loras"


def oracle(home: str, adapter: Path | None, n: int) -> list[int]:
    from mlx_lm.utils import load

    model = load(str(resolve_model("builtin:tiny", home)), adapter_path=str(adapter) if adapter else None)[0]
    return mlx_lm_greedy(model, PROMPT, n)[0]


def test_per_request_adapters_in_one_batch_match_mlx_lm(home: str, make_worker, lora_dir: Path) -> None:
    w = make_worker(lora_dir=str(lora_dir))
    assert w.add_lora({"lora_int_id": 1, "lora_name": "one", "lora_path": "one"})
    assert w.add_lora({"lora_int_id": 2, "lora_name": "two", "lora_path": "two"})
    assert not w.add_lora({"lora_int_id": 2, "lora_name": "two", "lora_path": "two"})  # already loaded
    assert w.list_loras() == [1, 2]
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    d.add("base", PROMPT)
    d.add("one", PROMPT)
    d.add("two", PROMPT)
    so = d.build(chunk=64)
    for req in so["scheduled_new_reqs"]:
        if req["req_id"] != "base":
            req["lora_request"] = {"lora_int_id": 1 if req["req_id"] == "one" else 2, "lora_name": req["req_id"]}
    d.commit(so, w.execute_model(so).to_wire())
    got = d.run(8)
    assert got["base"] == oracle(home, None, 8)
    assert got["one"] == oracle(home, lora_dir / "one", 8)
    assert got["two"] == oracle(home, lora_dir / "two", 8)
    assert len({tuple(v) for v in got.values()}) == 3  # the adapters really change the output
    assert not w.remove_lora(1)  # in use by a live request
    d.finish("one")
    d.step()
    assert w.remove_lora(1) and w.list_loras() == [2]


def test_lora_paths_stay_inside_the_lora_dir(make_worker, lora_dir: Path, tmp_path: Path) -> None:
    make_adapter_elsewhere = tmp_path / "outside"
    w = make_worker(lora_dir=str(lora_dir))
    for bad in ["../outside", "/etc", "one/../../outside", "nope"]:
        with pytest.raises(ProtocolError) as e:
            w.add_lora({"lora_int_id": 3, "lora_name": "x", "lora_path": bad})
        assert e.value.field == "lora_request.lora_path"
    (lora_dir / "link").symlink_to(make_adapter_elsewhere)
    with pytest.raises(ProtocolError, match="outside"):
        w.add_lora({"lora_int_id": 3, "lora_name": "x", "lora_path": "link"})
    assert w.list_loras() == []
    without = make_worker()
    with pytest.raises(ProtocolError, match="--lora-dir"):
        without.add_lora({"lora_int_id": 3, "lora_name": "x", "lora_path": "one"})


def test_unknown_adapter_in_a_request_is_rejected(make_worker, lora_dir: Path) -> None:
    w = make_worker(lora_dir=str(lora_dir))
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    d.add("x", PROMPT)
    so = d.build(chunk=64)
    so["scheduled_new_reqs"][0]["lora_request"] = {"lora_int_id": 9, "lora_name": "nine"}
    with pytest.raises(ProtocolError) as e:
        w.execute_model(so)
    assert e.value.field == "scheduled_new_reqs[0].lora_request.lora_int_id"
    assert w.runner.requests == {}


def test_slots_evict_the_oldest_unpinned_adapter(make_worker, lora_dir: Path) -> None:
    w = make_worker(lora_dir=str(lora_dir), max_loras=1)
    assert w.add_lora({"lora_int_id": 1, "lora_name": "one", "lora_path": "one"})
    assert w.add_lora({"lora_int_id": 2, "lora_name": "two", "lora_path": "two"})
    assert w.list_loras() == [2]
    assert w.pin_lora(2) and not w.pin_lora(7)
    assert not w.add_lora({"lora_int_id": 1, "lora_name": "one", "lora_path": "one"})  # the only slot is pinned
    assert w.list_loras() == [2]


def test_adapters_survive_sleep_level_2(home: str, make_worker, lora_dir: Path) -> None:
    w = make_worker(lora_dir=str(lora_dir))
    assert w.add_lora({"lora_int_id": 1, "lora_name": "one", "lora_path": "one"})
    w.sleep(2)
    w.wake_up()
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    d.add("one", PROMPT)
    so = d.build(chunk=64)
    so["scheduled_new_reqs"][0]["lora_request"] = {"lora_int_id": 1, "lora_name": "one"}
    d.commit(so, w.execute_model(so).to_wire())
    assert d.run(6)["one"] == oracle(home, lora_dir / "one", 6)
