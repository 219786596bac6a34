"""The largest-batch search below the batches its affine model came from: one more trace,
well below, checks the model there, and the probes between need none (resnet50 traced at
5000, whose largest batch is 540, had traced every probe below 2500)."""

from __future__ import annotations

from test_memory_estimate import cnn, shrunk

from boom_ml.gpus import get_gpu
from boom_ml.max_batch import CHECK_BELOW, max_batch_size
from boom_ml.memory.estimate import estimate_memory
from boom_ml.trace.graph import OpGraph


def test_a_search_far_below_the_traced_batch_checks_the_model_with_one_trace() -> None:
    traced: list[int] = []

    def trace_at(b: int) -> OpGraph:
        traced.append(b)
        return cnn(b)

    need = estimate_memory(cnn(20), get_gpu("a100-80gb-sxm")).p90_bytes
    gpu = shrunk("a100-80gb-sxm", need + 1)  # batch 20 fits, the answer is 20 or a bit more
    found = max_batch_size(cnn(256), gpu, trace_at=trace_at)
    # 128 for the model, then the first probe below it (64) checked at 64 / 8 = 8
    assert traced == [128, 64 // CHECK_BELOW] and found.scaled
    # the answer is the one real traces give at its boundary
    assert estimate_memory(cnn(found.batch_size), gpu).fits
    assert not estimate_memory(cnn(found.batch_size + 1), gpu).fits


def test_a_model_that_does_not_hold_below_traces_the_batch_asked() -> None:
    """A trace whose structure differs at the check (an extra event, as an HF decoder's mask
    path at batch 1 gives) is not taken for the model: the batch asked is traced and the
    search goes on with real traces."""
    traced: list[int] = []

    def trace_at(b: int) -> OpGraph:
        traced.append(b)
        graph = cnn(b)
        if b < 16:  # synthetic: small batches take another path, one event more
            events = graph.mem_events
            graph = OpGraph(graph.nodes, graph.edges, events.iloc[list(range(len(events))) + [0]]
                            .reset_index(drop=True), dict(graph.meta))  # fmt: skip
        return graph

    need = estimate_memory(cnn(20), get_gpu("a100-80gb-sxm")).p90_bytes
    gpu = shrunk("a100-80gb-sxm", need + 1)
    found = max_batch_size(cnn(256), gpu, trace_at=trace_at)
    assert traced[:3] == [128, 8, 64]  # the check at 8 failed: 64 itself is traced and matches
    assert 20 <= found.batch_size < 64
