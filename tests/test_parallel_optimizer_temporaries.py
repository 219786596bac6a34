"""A rank's peak inside and outside the optimizer step, each extrapolated and sharded.

PyTorch's foreach AdamW allocates the square roots of every second moment at once (one
tensor per parameter, the size of all parameters it steps). The traced step holds them for
the whole per-rank model; a ZeRO / FSDP rank steps only its shard and holds 1/dp of them.
The 1- and 2-layer models a profile traces can peak in the backward pass where the whole
model peaks in the optimizer step, so each window is extrapolated on its own and the rank's
memory is the larger (``MemoryProfile.windows``).
"""

from __future__ import annotations

import pytest

from boom_ml.parallel.layout import Layout
from boom_ml.parallel.memory import stage_memory
from boom_ml.parallel.memory_profile import MemoryProfile
from tests.test_parallel import LAYERS, SYNTHETIC_TINY_LLAMA, VOCAB, H, layer_params

GIB = 2**30


def _round(nbytes: int) -> int:
    return -(-nbytes // 512) * 512  # the caching allocator's 512-byte blocks


def test_the_traced_optimizer_temporaries_are_foreach_adamws_square_roots() -> None:
    from boom_ml.gpus import get_gpu
    from boom_ml.parallel.memory_profile import memory_profile
    from boom_ml.specs import StepSpec

    step = StepSpec(batch_size=2, seq_len=32, optimizer="adamw", optimizer_impl="foreach")
    prof = memory_profile(SYNTHETIC_TINY_LLAMA, 1, step, get_gpu("h100-sxm"))
    # the 1-layer model's tensors: embedding, q k v o, gate up down, two norms, final norm,
    # head; one fp32 square root each, all alive at the optimizer's peak
    shapes = [VOCAB * H] + [H * H] * 4 + [H * 128] * 3 + [H] * 3 + [VOCAB * H]
    opt = prof.windows["optimizer"]
    assert opt["optimizer_transient"][0] == sum(_round(4 * n) for n in shapes)
    assert set(prof.windows) <= {"zero_grad", "forward", "loss", "backward", "optimizer", "other"}
    assert all(
        prof.windows[w]["optimizer_transient"] == [0, 0] for w in prof.windows if w != "optimizer"
    )
    # the window that holds the step's peak reports the step's total
    assert max(view["totals"][0] for view in prof.windows.values()) == prof.totals[0]


def _synthetic_profile(transient: int, rest_total: int) -> MemoryProfile:
    """Synthetic numbers: a 1-layer trace of 10 GiB peaking in the optimizer with
    ``transient`` bytes of its temporaries (2 layers: 1 GiB and as many temporaries more),
    and ``rest_total`` at its peak outside the optimizer step (2 layers: 1 GiB more)."""
    per_layer = layer_params(1)
    opt = {
        "totals": [10 * GIB, 11 * GIB],
        "p10": [10 * GIB, 11 * GIB],
        "p90": [10 * GIB, 11 * GIB],
        "breakdowns": [{"temporary": transient}, {"temporary": 2 * transient}],
        "optimizer_transient": [transient, 2 * transient],
    }
    rest = {
        "totals": [rest_total, rest_total + GIB],
        "p10": [rest_total, rest_total + GIB],
        "p90": [rest_total, rest_total + GIB],
        "breakdowns": [{}, {}],
        "optimizer_transient": [0, 0],
    }
    return MemoryProfile(
        totals=opt["totals"], p10=opt["p10"], p90=opt["p90"], breakdowns=opt["breakdowns"],
        capacity_bytes=80 * GIB,
        params={"layers": per_layer, "first": VOCAB * H, "last": VOCAB * H + H, "tied": 0},
        param_bytes=4.0, optimizer_bytes=8.0, method="synthetic",
        windows={"optimizer": opt, "rest": rest},
    )  # fmt: skip


def test_sharded_temporaries_shrink_by_dp_and_the_other_window_bounds_them() -> None:
    dp = 4
    layout = Layout(dp=dp, sharding="zero1")
    prof = _synthetic_profile(transient=4 * GIB, rest_total=2 * GIB)
    out = stage_memory(prof, layout, 0, LAYERS, 1)
    # LAYERS = 2: the 2-layer trace's 8 GiB of temporaries, 3/4 of them gone
    assert out["parallel_terms"]["zero_optimizer_temporaries"] == -8 * GIB * (dp - 1) / dp
    # DDP steps everything (its gradients viewed into its buckets, which hold them all step:
    # the peak's traced gradients, none here, are inside them)
    unsharded = stage_memory(prof, Layout(dp=dp, bucket_view=True), 0, LAYERS, 1)
    assert "zero_optimizer_temporaries" not in unsharded["parallel_terms"]
    # the difference: the temporaries and the state ZeRO-1 shards, and DDP's buckets
    sharded = 6 * GIB - out["parallel_terms"]["zero_optimizer_state"]
    buckets = 4 * (LAYERS * layer_params(1) + 2 * VOCAB * H + H)
    assert unsharded["parallel_terms"]["ddp_bucket"] == buckets
    assert unsharded["total_bytes"] - out["total_bytes"] == pytest.approx(sharded + buckets, abs=2)
    # a peak outside the optimizer above the sharded one is the rank's peak
    high = _synthetic_profile(transient=4 * GIB, rest_total=9 * GIB)
    chosen = stage_memory(high, layout, 0, LAYERS, 1)
    assert "zero_optimizer_temporaries" not in chosen["parallel_terms"]
    assert chosen["total_bytes"] > out["total_bytes"]


def test_a_window_that_grows_faster_takes_over_at_depth() -> None:
    """1 and 2 layers peak outside the optimizer (12 > 10, 13 > 11 GiB), but the optimizer
    window grows by 3 GiB a layer against 1: at 8 layers it is the rank's peak."""
    prof = _synthetic_profile(transient=0, rest_total=12 * GIB)
    prof.windows["optimizer"]["totals"] = [10 * GIB, 13 * GIB]
    prof.windows["optimizer"]["p10"] = prof.windows["optimizer"]["p90"] = [10 * GIB, 13 * GIB]
    deep = stage_memory(prof, Layout(), 0, 8, 1)
    nccl = deep["parallel_terms"]["nccl_buffers"]
    assert deep["total_bytes"] - nccl == 10 * GIB + 7 * 3 * GIB  # not the rest's 12 + 7


@pytest.mark.parametrize("sharding", ["none", "zero1"])
def test_a_stage_holds_the_temporaries_of_what_it_steps(sharding) -> None:
    """A pipeline stage steps its own parameters: its foreach temporaries are its share of
    the traced model's (which holds the embedding and the head), by trainable parameters,
    then 1/dp of that under ZeRO. Every stage had been charged the traced model's."""
    dp = 2 if sharding == "zero1" else 1
    prof = _synthetic_profile(transient=4 * GIB, rest_total=2 * GIB)
    per_layer, first, last = layer_params(1), VOCAB * H, VOCAB * H + H
    traced = per_layer + first + last  # one layer each, as traced
    layout = Layout(pp=3, dp=dp, sharding=sharding, microbatches=3)
    for stage, held in ((0, per_layer + first), (1, per_layer), (2, per_layer + last)):
        out = stage_memory(prof, layout, stage, 1, 3)
        assert out["breakdown"]["temporary"] == int(4 * GIB * held / traced / dp)


@pytest.mark.parametrize(
    ("layout", "tied", "counts"),
    [
        (Layout(pp=4, microbatches=4), False, [1, 2, 2, 1]),  # a peer each side, if any
        (Layout(pp=4, microbatches=4), True, [2, 2, 2, 2]),  # and the embedding group
        (Layout(pp=2, microbatches=2), False, [1, 1]),  # one pair
        # interleaving joins the last stage to the first
        (Layout(pp=4, microbatches=4, schedule="interleaved", virtual_stages=2), False, [2] * 4),
        (Layout(pp=4, dp=2, tp=2, microbatches=4), False, [3, 4, 4, 3]),
    ],
)
def test_nccl_communicators_per_pipeline_stage(layout, tied, counts) -> None:
    """ProcessGroupNCCL makes a two-rank communicator per pair of ranks that send to each
    other: a first and last stage have one, a middle one two (all had been counted two)."""
    from boom_ml.parallel.memory import communicators

    assert [communicators(layout, s, tied) for s in range(layout.pp)] == counts
