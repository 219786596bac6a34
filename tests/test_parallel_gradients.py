"""Gradients of a layout's rank at its peaks (issue #14): what each sharding mode divides by
dp, what waits whole for its reduce-scatter, and the gradient a micro-batch computes beside its
kept copy, which only the stage holding that parameter holds. The model is the synthetic tiny
Llama of ``test_parallel.py``; the "synthetic" views below are peaks written by hand, the
allocator's bytes of a trace of it as a deeper model would reach them."""

from __future__ import annotations

import pytest

from boom_ml.memory.allocator_config import K_MIN_BLOCK_SIZE
from boom_ml.parallel.layout import Layout
from tests.test_parallel import INTER, LAYERS, VOCAB, H, layer_params, tiny_memory_profile


@pytest.fixture(scope="module")
def tiny_memory():
    return tiny_memory_profile()


@pytest.mark.parametrize("sharding", ["none", "zero1", "zero2", "zero3", "fsdp"])
def test_shard_sizes_under_each_mode(tiny_memory, sharding):
    from boom_ml.parallel.memory import stage_memory

    dp = 4
    held = LAYERS * layer_params(1) + 2 * VOCAB * H + H
    terms = stage_memory(tiny_memory, Layout(dp=dp, sharding=sharding, microbatches=2), 0,
                         LAYERS, 2)["parallel_terms"]  # fmt: skip
    stage = Layout(sharding=sharding).zero_stage
    expect = {"stage_parameters": 0}
    if stage >= 1:
        expect["zero_optimizer_state"] = -int(8 * held * (dp - 1) / dp)
    if stage >= 2:  # the gradients alive at the peak: all of them under accumulation
        grads = tiny_memory.breakdowns[1]["gradient"]
        assert 4 * held <= grads <= 4 * held + 512 * 40  # allocator rounding per tensor
        # at the backward's end what waits for its reduce-scatter stays whole: ZeRO-2 the
        # gradient just made (the embedding's), FSDP2 its unit's (a layer) and the root's
        whole = 4 * (VOCAB * H if stage == 2 else layer_params(1) + 2 * VOCAB * H + H)
        expect["zero_gradients"] = -(grads - whole) * (dp - 1) / dp
    if stage >= 3:
        expect["zero_parameters"] = -int(4 * held * (dp - 1) / dp)
        # two layer units, and the root (embedding, head, norm) gathered through backward
        expect["fsdp_allgather_buffers"] = 4 * (2 * layer_params(1) + 2 * VOCAB * H + H)
    if stage == 0:  # PyTorch's default: the buckets copy every gradient (fp32 here)
        expect["ddp_bucket"] = 4 * held
    expect["nccl_buffers"] = 1 * 4 * 2**20 * 8 * 2  # one communicator (dp)
    assert terms == pytest.approx(expect, abs=1)  # terms are whole bytes
    if stage == 0:  # gradient_as_bucket_view=True: the gradients are views into the buckets,
        # which hold them all step: with those the peak holds, one copy (it had been one 25 MiB
        # bucket, whatever the peak held: a hunt)
        viewed = stage_memory(tiny_memory, Layout(dp=dp, bucket_view=True, microbatches=2), 0,
                              LAYERS, 2)  # fmt: skip
        grads = viewed["breakdown"].get("gradient", 0)
        assert viewed["parallel_terms"]["ddp_bucket"] + grads == max(4 * held, grads)


def _synthetic_view(prof, fresh: int) -> dict:
    """A backward peak holding every gradient of the 1- and 2-layer models, each rounded up
    by a whole 512-byte block (the most the allocator rounds), plus ``fresh`` bytes of a
    gradient computed beside its kept copy; nothing else."""
    n = prof.tensors
    grads = [4 * (k * layer_params(1) + 2 * VOCAB * H + H)
             + K_MIN_BLOCK_SIZE * (k * n["layers"] + n["first"] + n["last"]) + fresh
             for k in (1, 2)]  # fmt: skip
    return {"totals": grads, "p10": grads, "p90": grads,
            "breakdowns": [{"gradient": g} for g in grads]}  # fmt: skip


def test_the_profile_knows_each_roles_largest_tensor_and_count(tiny_memory):
    # a layer: q, k, v, o (64 x 64), gate, up, down (64 x 128), two norms; the embedding; the
    # head (256 x 64) and the final norm
    assert tiny_memory.largest == {"layers": INTER * H, "first": VOCAB * H, "last": VOCAB * H}
    assert tiny_memory.tensors == {"layers": 9, "first": 1, "last": 2}


def test_a_fresh_gradient_is_held_by_the_stage_that_holds_its_parameter(tiny_memory):
    """The head's gradient of a second micro-batch, beside its kept copy at the backward's
    start: the last stage holds it whole, a middle stage at most its largest tensor (an MLP
    weight's), the first the embedding's; it had been shared out by parameter count."""
    from boom_ml.parallel.memory import _stage_at

    head = 4 * VOCAB * H
    view = _synthetic_view(tiny_memory, fresh=head)
    layout = Layout(pp=4, microbatches=4)
    held = {0: 2 * layer_params(1) + VOCAB * H, 1: 2 * layer_params(1),
            3: 2 * layer_params(1) + VOCAB * H + H}  # fmt: skip
    fresh = {0: head, 1: 4 * INTER * H, 3: head}
    for stage in (0, 1, 3):
        grad = _stage_at(tiny_memory, view, layout, stage, 2, 4)["breakdown"]["gradient"]
        kept = grad - fresh[stage]
        # the kept gradients are the stage's own, with its share of the allocator's rounding
        assert 4 * held[stage] <= kept <= 4 * held[stage] + K_MIN_BLOCK_SIZE * 21


@pytest.mark.parametrize("accumulating", [False, True])
def test_sharded_gradients_keep_what_waits_for_its_reduce_scatter_whole(tiny_memory, accumulating):
    """At a backward's peak without a pipeline: ZeRO-2 reduces each gradient as it is made,
    so the last made (the embedding's, the largest) is whole; FSDP2 reduces a unit's after its
    backward, so a layer's and the root's (embedding, head, final norm) are. Under
    accumulation the kept gradients are shards and the fresh one waits whole (FSDP2: with its
    unit's and the root's)."""
    from boom_ml.parallel.memory import _stage_at

    dp, head = 4, 4 * VOCAB * H
    view = _synthetic_view(tiny_memory, fresh=head if accumulating else 0)
    traced = view["breakdowns"][1]["gradient"]
    kept = traced - (head if accumulating else 0)
    root_and_layer = 4 * (layer_params(1) + 2 * VOCAB * H + H)
    for sharding, waiting in (("zero2", head), ("fsdp", root_and_layer)):
        layout = Layout(dp=dp, sharding=sharding, microbatches=2 if accumulating else 1)
        grad = _stage_at(tiny_memory, view, layout, 0, LAYERS, 1)["breakdown"]["gradient"]
        if accumulating:
            expect = kept / dp + (head if sharding == "zero2" else root_and_layer)
        else:
            expect = (kept - waiting) / dp + waiting
        assert grad == pytest.approx(expect, abs=1)
    # the optimizer step's gradients are all reduced to their shards
    drained = _stage_at(tiny_memory, view, Layout(dp=dp, sharding="zero2"), 0, LAYERS, 1,
                        drained=True)["breakdown"]["gradient"]  # fmt: skip
    assert drained == pytest.approx(traced / dp, abs=1)


def test_the_categories_add_up_to_the_total_where_dp_does_not_divide_them(tiny_memory):
    from boom_ml.parallel.memory import stage_memory

    for sharding in ("zero1", "zero2", "fsdp"):
        out = stage_memory(tiny_memory, Layout(dp=3, sharding=sharding), 0, LAYERS, 1)
        assert sum(out["breakdown"].values()) == out["total_bytes"]


def test_master_weights_gradients_are_scaled_as_traced_and_the_buckets_kept(tiny_memory):
    """Under master weights the traced gradients are the 16-bit ones and fp32 copies beside
    them: none is a fresh gradient (2N bytes of fp32 copies had been read as one and cut to
    the largest tensor: 1.9 GB short), and a viewed DDP bucket is charged whole beside them
    (it had vanished beside 7.7 GB of fp32 gradients: a review)."""
    from dataclasses import replace

    from boom_ml.parallel.memory import _stage_at

    prof = replace(tiny_memory, master_weights=True, param_bytes=2.0, grad_bytes=2.0)
    every = LAYERS * layer_params(1) + 2 * VOCAB * H + H
    view = _synthetic_view(tiny_memory, fresh=0)
    fp32 = 4 * every  # the fp32 copies beside the 16-bit gradients
    view = {**view, "breakdowns": [{"gradient": b["gradient"] + fp32} for b in view["breakdowns"]]}
    traced = view["breakdowns"][1]["gradient"]
    out = _stage_at(prof, view, Layout(dp=2, bucket_view=True), 0, LAYERS, 1)
    assert out["breakdown"]["gradient"] == traced
    assert out["parallel_terms"]["ddp_bucket"] == 2 * every
