"""A cuDNN-attention step re-expressed from the flash step (``trace/cudnn_from_flash.py``)
equals the step traced for the cuDNN group, node for node and event for event; where it
cannot be re-expressed, nothing is derived; a session traces the flash group only.

The model is a synthetic tiny Llama config (GQA: 4 query, 2 key/value heads, head dim 16),
not a published model.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pandas as pd
import pytest

import boom_ml.session as session_module
from boom_ml import api
from boom_ml.gpus import parse_gpu_list
from boom_ml.specs import ModelSpec, StepSpec
from boom_ml.trace.cudnn_from_flash import cudnn_from_flash, derivable
from boom_ml.trace.graph import OpGraph
from boom_ml.trace.step import trace_step
from boom_ml.zoo import build_model
from tests.test_attention_backend import _count_traces
from tests.tiny_models import tiny_llama_config

FLASH, CUDNN = "sm80", "sm90-cudnn-d256"


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> ModelSpec:
    path = tmp_path_factory.mktemp("flash_llama") / "config.json"
    path.write_text(json.dumps(tiny_llama_config(vocab_size=1000)))
    return ModelSpec(f"hf:{path}", {"attn_implementation": "sdpa"})


def _trace(model: ModelSpec, group: str, **step: object) -> OpGraph:
    spec = StepSpec(batch_size=2, seq_len=32, sdpa_group=group, **step)
    return trace_step(build_model(model), spec)


def _assert_same(derived: OpGraph, traced: OpGraph) -> None:
    for table in ("nodes", "edges", "mem_events"):
        pd.testing.assert_frame_equal(getattr(derived, table), getattr(traced, table))
    drop = {"trace_seconds"}
    assert {k: v for k, v in derived.meta.items() if k not in drop} == {
        k: v for k, v in traced.meta.items() if k not in drop
    }


@pytest.mark.parametrize(
    "step",
    [
        {"amp": "bf16"},
        {"amp": "fp16", "checkpointing": "full"},
        {"params_dtype": "bf16", "finetune_method": "lora", "optimizer": "adamw8bit"},
        {"amp": "bf16", "zero_grad": "zero", "checkpointing": "selective"},
    ],
)
def test_derived_cudnn_step_equals_the_traced_one(llama: ModelSpec, step: dict) -> None:
    flash, cudnn = _trace(llama, FLASH, **step), _trace(llama, CUDNN, **step)
    assert set(flash.meta["sdpa"]["backends"]) == {"flash"}
    assert set(cudnn.meta["sdpa"]["backends"]) == {"cudnn"}
    derived = cudnn_from_flash(flash, CUDNN)
    assert derived is not None
    _assert_same(derived, cudnn)
    # what changed: each layer's forward (and recomputed forward) and backward op renamed,
    # one empty debug mask per forward gone (an alloc and a free)
    forwards = int((flash.nodes.op == "_scaled_dot_product_flash_attention").sum())
    assert forwards == (4 if step.get("checkpointing") == "full" else 2)  # 2 layers
    assert (derived.nodes.op != flash.nodes.op).sum() == forwards + 2
    assert len(flash.mem_events) - len(derived.mem_events) == 2 * forwards


def test_a_non_causal_encoder_derives_too() -> None:
    """A ViT (synthetic small config: 1 layer, 4 heads of 16): no mask, not causal."""
    vit = ModelSpec("hf:google/vit-base-patch16-224", {"num_hidden_layers": 1, "hidden_size": 64,
                    "num_attention_heads": 4, "intermediate_size": 128, "image_size": 32})  # fmt: skip
    step = StepSpec(batch_size=2, amp="bf16")
    flash = trace_step(build_model(vit), replace(step, sdpa_group=FLASH))
    cudnn = trace_step(build_model(vit), replace(step, sdpa_group=CUDNN))
    assert flash.meta["sdpa"]["inputs"][0]["is_causal"] is False
    derived = cudnn_from_flash(flash, CUDNN)
    assert derived is not None
    _assert_same(derived, cudnn)


def test_nothing_is_derived_where_the_kernels_do_not_map(llama: ModelSpec) -> None:
    flash = _trace(llama, FLASH, amp="bf16")
    assert cudnn_from_flash(flash, "sm86") is None  # flash there too: the same graph serves
    assert cudnn_from_flash(flash, "sm70") is None  # memory-efficient: traced
    assert cudnn_from_flash(_trace(llama, CUDNN, amp="bf16"), FLASH) is None  # one way only
    fp32 = _trace(llama, FLASH)  # no flash kernel in fp32: memory-efficient in both groups
    assert set(fp32.meta["sdpa"]["backends"]) == {"efficient"}
    assert cudnn_from_flash(fp32, CUDNN) is None
    call = flash.meta["sdpa"]["inputs"][0]
    padded = {**call, "query": {**call["query"], "shape": [2, 4, 32, 12]}}  # flash pads to 16
    masked = {**call, "attn_mask": {**call["query"], "shape": [2, 1, 32, 32]}}
    no_grad = {**call, "requires_grad": False}  # cuDNN computes no log-sum-exp then
    dropout = {**call, "dropout_p": 0.125}  # cuDNN takes it (1/16ths): not compared
    for other in (padded, masked, no_grad, dropout):
        assert not derivable({**flash.meta["sdpa"], "inputs": [other]}, CUDNN)
    assert derivable(flash.meta["sdpa"], CUDNN)


def test_a_session_traces_the_flash_group_once_for_both(
    llama: ModelSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _count_traces(monkeypatch)
    gpus = parse_gpu_list(["h100-sxm", "a100-80gb-sxm", "b200"])
    step = StepSpec(batch_size=2, seq_len=32, amp="bf16")
    session = api.Session(llama.text, cache=False, options=llama.options)
    derived = session.evaluate(step, gpus, max_batch=True)
    assert [c.sdpa_group for c in calls] == [FLASH] * len(calls)  # the batch search's too
    # predict() reads the first GPU's graph back: the H100's, re-expressed
    graph = session.graph(replace(step, grad_accum=1))
    assert graph.meta["step"]["sdpa_group"] == CUDNN and graph.meta["sdpa"]["backends"] == {
        "cudnn": 2
    }
    # the same predictions as tracing the cuDNN group
    monkeypatch.setattr(session_module, "cudnn_from_flash", lambda graph, group: None)
    monkeypatch.setattr(session_module, "derivable", lambda sdpa, group: False)
    traced = api.Session(llama.text, cache=False, options=llama.options).evaluate(
        step, gpus, max_batch=True
    )
    assert CUDNN in {c.sdpa_group for c in calls}
    assert derived == traced
