"""Gradient accumulation under a layout: micro-batches 2..N add into the kept gradients
(``parallel.grad_accumulation=add``, PyTorch's autograd) or inside the weight-gradient GEMMs
(``fused``, Megatron-LM's gradient accumulation fusion: no add kernels)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from boom_ml.errors import InvalidInputError
from boom_ml.parallel.layout import Layout
from boom_ml.parallel.time import step_time
from tests.test_parallel import SYNTHETIC_TINY_LLAMA, _groups, _profile, _shape

LAYER_ADDS, ENDS_ADDS = 0.5, 0.2  # synthetic ms per further micro-batch


def _adding_profile():
    return replace(_profile(), accumulate_layer_ms=LAYER_ADDS, accumulate_ends_ms=ENDS_ADDS)


def _time(layout: Layout, per_stage: list[int], **groups: int) -> dict:
    return step_time(_adding_profile(), _shape(1), layout, per_stage, _groups(**groups))


def test_each_later_micro_batch_adds_once() -> None:
    """One rank, 4 micro-batches over 6 layers: 3 x (6 x layer adds + the ends' adds)."""
    added = _time(Layout(microbatches=4), [6])
    fused = _time(Layout(microbatches=4, grad_accumulation="fused"), [6])
    expected = 3 * (6 * LAYER_ADDS + ENDS_ADDS)
    assert added["accumulate_ms"] == pytest.approx(expected, abs=1e-3)
    assert fused["accumulate_ms"] == 0.0
    assert added["step_ms"] - fused["step_ms"] == pytest.approx(expected, abs=1e-3)
    assert _time(Layout(microbatches=1, dp=2), [6], dp=2)["accumulate_ms"] == 0.0


def test_pipeline_stages_split_the_ends_by_their_parameters() -> None:
    """pp=2 over 2 + 4 layers: the embedding's adds on the first stage, the head's on the
    last, in proportion to their trainable parameters (``_shape``: V*H and V*H + H)."""
    out = _time(Layout(pp=2, microbatches=4), [2, 4], pp=2)
    first, last = 256 * 64, 256 * 64 + 64
    stage = {s["stage"]: s["accumulate_ms"] for s in out["per_stage"]}
    assert stage[0] == pytest.approx(
        3 * (2 * LAYER_ADDS + ENDS_ADDS * first / (first + last)), abs=1e-4
    )
    assert stage[1] == pytest.approx(
        3 * (4 * LAYER_ADDS + ENDS_ADDS * last / (first + last)), abs=1e-4
    )


@pytest.mark.parametrize(("sharding", "share"), [("none", 1), ("zero1", 1), ("zero2", 4),
                                                  ("fsdp", 4)])  # fmt: skip
def test_sharded_gradients_add_into_their_shards(sharding: str, share: int) -> None:
    """ZeRO-2 and FSDP reduce-scatter each micro-batch and add into the rank's 1/dp shard;
    DDP and ZeRO-1 accumulate whole gradients."""
    out = _time(Layout(dp=4, sharding=sharding, microbatches=3), [6], dp=4)
    assert out["accumulate_ms"] == pytest.approx(2 * (6 * LAYER_ADDS + ENDS_ADDS) / share, abs=1e-4)


def test_unknown_mode_is_one_line() -> None:
    with pytest.raises(InvalidInputError, match="unknown parallel.grad_accumulation 'fuse'"):
        Layout(grad_accumulation="fuse")


@pytest.mark.parametrize("name", ["tiny-llama", "gpt2"])
def test_profile_adds_extrapolate_to_the_whole_model(name: str) -> None:
    """The 1- and 2-layer traces' adds, extrapolated to the model's depth, are the adds the
    whole model's own trace records (timing/accumulation.py on its gradients). gpt2: its
    embedding's gradient, in both small traces, had set both mean sizes, and the layer's
    adds came out at half the whole model's."""
    from boom_ml.gpus import get_gpu
    from boom_ml.parallel.profile import time_profiles
    from boom_ml.parallel.shard import load_raw, rank_model
    from boom_ml.specs import StepSpec
    from boom_ml.timing.accumulation import gradient_adds_ms
    from boom_ml.timing.tf32 import Tf32
    from boom_ml.trace.step import trace_step
    from boom_ml.zoo import build_model

    if name == "gpt2":
        raw, layers, seq = load_raw("hf:gpt2"), 12, 256
    else:
        raw, layers, seq = {**SYNTHETIC_TINY_LLAMA, "num_hidden_layers": 4}, 4, 32
    step, gpu = StepSpec(batch_size=2, seq_len=seq, optimizer="adamw"), get_gpu("l4")
    (prof,) = time_profiles(raw, 1, step, [gpu])
    assert prof.accumulate_layer_ms > 0 and prof.accumulate_ends_ms > 0
    whole_model = rank_model(json.dumps(raw, sort_keys=True))  # every layer, as configured
    graph = trace_step(build_model(whole_model), step)
    (whole,) = gradient_adds_ms(graph, [gpu], Tf32.of(False))
    extrapolated = layers * prof.accumulate_layer_ms + prof.accumulate_ends_ms
    # both sides time each dtype's gradients at one mean size (the whole model's mixes the
    # embedding with the layers: gpt2 7.44 against 7.87 ms); the split timing was 4.14
    assert extrapolated == pytest.approx(whole, rel=0.06)
