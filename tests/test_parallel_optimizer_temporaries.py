"""ZeRO / FSDP ranks step only their shard: the optimizer's own temporaries shrink by dp.

PyTorch's foreach AdamW allocates the square roots of every second moment at once (one
tensor per parameter, the size of all parameters it steps). The traced step holds them for
the whole per-rank model; a sharded rank holds 1/dp of them. The rank's memory is then the
larger of two peaks: the traced one with those temporaries sharded, and the one of the replay
without them (``MemoryProfile.lean``).
"""

from __future__ import annotations

import pytest

from boom_ml.parallel.layout import Layout
from boom_ml.parallel.memory import DDP_BUCKET_BYTES, stage_memory
from boom_ml.parallel.profile import MemoryProfile
from tests.test_parallel import LAYERS, SYNTHETIC_TINY_LLAMA, VOCAB, H, layer_params

GIB = 2**30


def _round(nbytes: int) -> int:
    return -(-nbytes // 512) * 512  # the caching allocator's 512-byte blocks


def test_the_traced_optimizer_temporaries_are_foreach_adamws_square_roots() -> None:
    from boom_ml.gpus import get_gpu
    from boom_ml.parallel.profile import _graphs, _lean, memory_profile
    from boom_ml.specs import StepSpec

    step = StepSpec(batch_size=2, seq_len=32, optimizer="adamw", optimizer_impl="foreach")
    prof = memory_profile(SYNTHETIC_TINY_LLAMA, 1, step, get_gpu("h100-sxm"))
    # the 1-layer model's tensors: embedding, q k v o, gate up down, two norms, final norm,
    # head; one fp32 square root each, all alive at the optimizer's peak
    shapes = [VOCAB * H] + [H * H] * 4 + [H * 128] * 3 + [H] * 3 + [VOCAB * H]
    assert prof.optimizer_transient[0] == sum(_round(4 * n) for n in shapes)
    graph = _graphs(SYNTHETIC_TINY_LLAMA, 1, step)[0][0]
    lean = _lean(graph).mem_events
    left = lean[(lean.phase == "optimizer") & (lean.category == "temporary")]
    assert left.empty and len(lean) < len(graph.mem_events)
    assert prof.lean is not None and len(prof.lean["totals"]) == 2


def _synthetic_profile(transient: int, lean_total: int) -> MemoryProfile:
    """Synthetic numbers: a 1-layer trace of 10 GiB peaking in the optimizer with
    ``transient`` bytes of its temporaries; 2 layers add 1 GiB and as much again."""
    per_layer = layer_params(1)
    bd = [{"temporary": transient, "optimizer_state": 0}, {"temporary": 2 * transient}]
    return MemoryProfile(
        totals=[10 * GIB, 11 * GIB], p10=[10 * GIB, 11 * GIB], p90=[10 * GIB, 11 * GIB],
        breakdowns=bd, capacity_bytes=80 * GIB,
        params={"layers": per_layer, "first": VOCAB * H, "last": VOCAB * H + H, "tied": 0},
        param_bytes=4.0, optimizer_bytes=8.0, method="synthetic",
        optimizer_transient=[transient, 2 * transient],
        lean={"totals": [lean_total, lean_total + GIB], "p10": [lean_total, lean_total + GIB],
              "p90": [lean_total, lean_total + GIB], "breakdowns": [{}, {}]},
    )  # fmt: skip


def test_sharded_temporaries_shrink_by_dp_and_the_lean_peak_bounds_them() -> None:
    dp = 4
    layout = Layout(dp=dp, sharding="zero1")
    prof = _synthetic_profile(transient=4 * GIB, lean_total=2 * GIB)
    out = stage_memory(prof, layout, 0, LAYERS, 1)
    # LAYERS = 2: the 2-layer trace's 8 GiB of temporaries, 3/4 of them gone
    assert out["parallel_terms"]["zero_optimizer_temporaries"] == -8 * GIB * (dp - 1) / dp
    unsharded = stage_memory(prof, Layout(dp=dp), 0, LAYERS, 1)  # DDP steps everything
    assert "zero_optimizer_temporaries" not in unsharded["parallel_terms"]
    # the difference: the temporaries and the state ZeRO-1 shards, less DDP's bucket
    sharded = 6 * GIB - out["parallel_terms"]["zero_optimizer_state"]
    assert unsharded["total_bytes"] - out["total_bytes"] == pytest.approx(
        sharded + DDP_BUCKET_BYTES, abs=2
    )
    # a lean peak above the sharded one is the rank's peak
    high = _synthetic_profile(transient=4 * GIB, lean_total=9 * GIB)
    chosen = stage_memory(high, layout, 0, LAYERS, 1)
    assert "zero_optimizer_temporaries" not in chosen["parallel_terms"]
    assert chosen["total_bytes"] > out["total_bytes"]
