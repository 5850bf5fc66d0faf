"""sidecar.vllm.convert on vLLM's own objects: what it sends decodes under the sidecar's v2 schema, and
replies become the vLLM types (and dtypes) vLLM's engine reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from vllm import SamplingParams
from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
from vllm.v1.core.sched.output import CachedRequestData, GrammarOutput, NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from vllm.v1.outputs import LogprobsLists, LogprobsTensors

from sidecar.wire.protocol import SchedulerOutput as WireSchedulerOutput
from sidecar.vllm import convert
from sidecar.vllm.worker import sidecar_settings


def _vllm_step() -> SchedulerOutput:
    sp = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True, stop_token_ids=[7], logprobs=1,
                        prompt_logprobs=0, logit_bias={5: 1.5})
    new = NewRequestData(req_id="a", prompt_token_ids=[3, 4, 5], mm_features=[], sampling_params=sp, pooling_params=None,
                         block_ids=([0],), num_computed_tokens=0, lora_request=None, prefill_token_ids=[3, 4, 5, 9])
    cached = CachedRequestData(req_ids=["b"], resumed_req_ids=set(), new_token_ids=[], all_token_ids={},
                               new_block_ids=[([2],)], num_computed_tokens=[16], num_output_tokens=[3])
    return SchedulerOutput(scheduled_new_reqs=[new], scheduled_cached_reqs=cached, num_scheduled_tokens={"a": 4, "b": 1},
                           total_num_scheduled_tokens=5, scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
                           finished_req_ids={"z"}, free_encoder_mm_hashes=[], preempted_req_ids={"y"},
                           kv_cache_block_copies=[KVCacheBlockCopy(1, 3)])


def test_scheduler_output_decodes_under_the_sidecar_schema() -> None:
    wire = convert.scheduler_output(_vllm_step())
    out = WireSchedulerOutput.from_wire(wire, vocab_size=512, max_logprobs=20)
    nr = out.scheduled_new_reqs[0]
    assert nr.prefill_token_ids == [3, 4, 5, 9] and nr.block_ids == [[0]]
    sp = nr.sampling_params
    assert sp.ignore_eos and sp.stops_complete and not sp.adds_eos and sp.stop_token_ids == (7,)
    assert sp.prompt_logprobs_whole and sp.logprobs == 1 and sp.logit_bias == {5: 1.5}
    assert out.scheduled_cached_reqs.new_token_ids == [[]]  # vLLM's [] read as one empty list per request
    assert out.kv_cache_block_copies == [(1, 3)]
    assert (out.finished_req_ids, out.preempted_req_ids) == (["z"], ["y"])


def test_replies_become_vllm_objects() -> None:
    d = {"req_ids": ["a"], "req_id_to_index": {"a": 0}, "sampled_token_ids": [[9]],
         "logprobs": {"logprob_token_ids": [[9, 9]], "logprobs": [[-0.5, -0.5]], "sampled_token_ranks": [1],
                      "cu_num_generated_tokens": None},
         "prompt_logprobs_dict": {"a": {"logprob_token_ids": [[4], [5]], "logprobs": [[-1.0], [-2.0]],
                                        "selected_token_ranks": [3, 1]}},
         "num_nans_in_logits": None}
    out = convert.model_runner_output(d)
    assert isinstance(out.logprobs, LogprobsLists) and out.logprobs.logprob_token_ids.dtype == np.int32
    plp = out.prompt_logprobs_dict["a"]
    assert isinstance(plp, LogprobsTensors)
    assert plp.logprob_token_ids.shape == (2, 1) and plp.logprobs.dtype == torch.float32
    assert plp.selected_token_ranks.tolist() == [3, 1]
    specs = convert.kv_cache_spec({
        "l0": {"type": "full_attention", "block_size": 16, "num_kv_heads": 2, "head_size": 16, "head_size_v": 16,
               "dtype": "float32", "sliding_window": None, "page_size_bytes": 4096},
        "l1": {"type": "sliding_window", "block_size": 16, "num_kv_heads": 2, "head_size": 16, "head_size_v": 16,
               "dtype": "bfloat16", "sliding_window": 64, "page_size_bytes": 2048}})
    assert isinstance(specs["l0"], FullAttentionSpec) and specs["l0"].page_size_bytes == 4096
    assert isinstance(specs["l1"], SlidingWindowSpec) and specs["l1"].dtype == torch.bfloat16
    assert specs["l1"].page_size_bytes == 2048
    g = convert.grammar_output(GrammarOutput(["a"], np.array([[-1, 5]], np.int32)))
    assert np.frombuffer(g["grammar_bitmask"], "<i4").tolist() == [-1, 5]
    assert convert.draft_token_ids(None) is None
    assert convert.draft_token_ids({"req_ids": ["a"], "draft_token_ids": [[1, 2]]}).draft_token_ids == [[1, 2]]


def test_settings_come_from_additional_config_then_env(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("MLX_SIDECAR_URL", "http://env:1")
    monkeypatch.setenv("MLX_SIDECAR_AUTH_TOKEN", "envtok")
    assert sidecar_settings({})["url"] == "http://env:1"
    assert sidecar_settings({})["token"] == "envtok"
    (tmp_path / "tok").write_text("filetok\n")
    s = sidecar_settings({"mlx_sidecar": {"url": "http://mac:8000", "auth_token_file": str(tmp_path / "tok")}})
    assert (s["url"], s["token"]) == ("http://mac:8000", "filetok")  # vLLM's config wins over the environment
    assert sidecar_settings({"mlx_sidecar": {"auth_token": "cfg"}})["token"] == "cfg"
    with pytest.raises(convert.Unsupported, match="unknown"):
        sidecar_settings({"mlx_sidecar": {"ur1": "x"}})


def test_vllms_placeholder_drafts_are_not_sent_and_not_counted() -> None:
    step = _vllm_step()
    # vLLM pads a draftless decode to 1 + k positions of -1; "b" has one real draft, then the padding.
    step.scheduled_spec_decode_tokens = {"b": [11, -1, -1]}
    step.num_scheduled_tokens = {"a": 4, "b": 4}
    step.total_num_scheduled_tokens = 8
    wire = convert.scheduler_output(step)
    assert wire["scheduled_spec_decode_tokens"] == {"b": [11]}
    assert wire["num_scheduled_tokens"] == {"a": 4, "b": 2} and wire["total_num_scheduled_tokens"] == 6
    step.scheduled_spec_decode_tokens = {"b": [-1, -1, -1]}
    wire = convert.scheduler_output(step)
    assert wire["scheduled_spec_decode_tokens"] == {} and wire["num_scheduled_tokens"]["b"] == 1
    WireSchedulerOutput.from_wire(wire, vocab_size=512, max_logprobs=20)
    step.scheduled_spec_decode_tokens = {"b": [11, 12]}  # real drafts pass unchanged (the control)
    step.num_scheduled_tokens = {"a": 4, "b": 3}
    assert convert.scheduler_output(step)["num_scheduled_tokens"]["b"] == 3


def test_speculative_config_becomes_init_device_overrides_or_a_named_refusal() -> None:
    from types import SimpleNamespace

    assert convert.speculative_config(None) == {"speculative_method": "none"}
    ngram = SimpleNamespace(method="ngram", num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=3)
    assert convert.speculative_config(ngram) == {"speculative_method": "ngram", "num_speculative_tokens": 2,
                                                 "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    draft = SimpleNamespace(method="draft_model", num_speculative_tokens=4, model="/vllm/side/dir")
    assert convert.speculative_config(draft) == {"speculative_method": "draft_model", "num_speculative_tokens": 4}
    for method in ("eagle", "suffix", "mtp"):
        with pytest.raises(convert.Unsupported, match=f"method '{method}' is not supported through the MLX sidecar"):
            convert.speculative_config(SimpleNamespace(method=method))


def test_quantised_specs_give_vllm_the_sidecars_exact_page_size() -> None:
    q8 = {"type": "full_attention", "block_size": 16, "num_kv_heads": 2, "head_size": 64, "head_size_v": 64,
          "dtype": "float32", "sliding_window": None, "page_size_bytes": 16 * 2 * 2 * (64 + 8),
          "kv_quantization": {"bits": 8, "group_size": 64}}
    spec = convert.kv_cache_spec({"l0": q8})["l0"]
    assert isinstance(spec, FullAttentionSpec) and spec.page_size_bytes == 4608
    assert spec.state_content_bytes == 2 * (64 + 8) and spec.dtype == torch.float32  # the scales' dtype
    unquantised = {k: v for k, v in q8.items() if k != "kv_quantization"}  # control: the same spec unquantised
    with pytest.raises(convert.Unsupported, match="page size 16384 differs from the sidecar's 4608"):
        convert.kv_cache_spec({"l0": unquantised})
    with pytest.raises(convert.Unsupported, match="not 2 KV heads x 16 tokens of whole bytes"):
        convert.kv_cache_spec({"l0": {**q8, "page_size_bytes": 4609}})
    convert.cache_dtype("auto")
    for dtype in ("fp8", "int8_per_token_head"):
        with pytest.raises(convert.Unsupported, match=f"--kv-cache-dtype {dtype} .* --kv-dtype 8bit or 4bit"):
            convert.cache_dtype(dtype)


def test_pooling_requests_carry_the_pooler_configs_type_and_results_become_tensors() -> None:
    from vllm.config import PoolerConfig
    from vllm.pooling_params import PoolingParams

    so = _vllm_step()
    so.scheduled_new_reqs[0].sampling_params = None
    so.scheduled_new_reqs[0].pooling_params = PoolingParams(task="embed", dimensions=8, use_activation=True)
    so.scheduled_new_reqs[0].prefill_token_ids = None
    so.num_scheduled_tokens["a"], so.total_num_scheduled_tokens = 3, 4
    wire = convert.scheduler_output(so, PoolerConfig(seq_pooling_type="MEAN", tok_pooling_type="ALL"))
    nr = WireSchedulerOutput.from_wire(wire, vocab_size=512, max_logprobs=20).scheduled_new_reqs[0]
    assert (nr.pooling_params.task, nr.pooling_params.pooling_type, nr.pooling_params.dimensions) == ("embed", "MEAN", 8)
    assert wire["scheduled_new_reqs"][0]["sampling_params"] is None
    so.scheduled_new_reqs[0].pooling_params = PoolingParams(task="plugin")
    with pytest.raises(convert.Unsupported, match="plugin"):
        convert.scheduler_output(so, PoolerConfig(seq_pooling_type="MEAN"))
    out = convert.model_runner_output({"req_ids": ["a", "b"], "req_id_to_index": {"a": 0, "b": 1},
                                       "sampled_token_ids": [[], [5]], "pooler_output": [[0.6, 0.8], None]})
    assert out.pooler_output[1] is None and out.pooler_output[0].dtype == torch.float32
    assert out.pooler_output[0].tolist() == pytest.approx([0.6, 0.8])


def test_pooler_settings_the_sidecar_cannot_honour_are_refused() -> None:
    from vllm.config import PoolerConfig

    convert.pooler_config(PoolerConfig(seq_pooling_type="LAST"), enable_prefix_caching=True)
    with pytest.raises(convert.Unsupported, match="prefix"):
        convert.pooler_config(PoolerConfig(seq_pooling_type="MEAN"), enable_prefix_caching=True)
    convert.pooler_config(PoolerConfig(seq_pooling_type="MEAN"), enable_prefix_caching=False)
    with pytest.raises(convert.Unsupported, match="logit_mean"):
        convert.pooler_config(PoolerConfig(seq_pooling_type="LAST", logit_mean=0.5), enable_prefix_caching=False)
