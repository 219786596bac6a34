"""Collective sizes of a layout (issue #14): the bytes and calls of each data-, tensor- and
pipeline-parallel collective equal the analytic ones for the synthetic tiny Llama of
``test_parallel.py``."""

from __future__ import annotations

import pytest

from boom_ml.parallel.layout import Cluster, Layout
from boom_ml.parallel.time import step_time
from tests.test_parallel import (
    LAYERS,
    SYNTHETIC_TINY_LLAMA,
    VOCAB,
    H,
    _groups,
    _profile,
    _shape,
    layer_params,
)


def test_ddp_all_reduce_bytes():
    out = step_time(_profile(), _shape(1), Layout(dp=4, microbatches=3), [LAYERS], _groups(dp=4))
    (ddp,) = [c for c in out["collectives"] if c["group"] == "dp"]
    assert ddp["op"] == "all_reduce" and ddp["calls"] == 1
    assert ddp["bytes"] == 4 * (LAYERS * layer_params(1) + 2 * VOCAB * H + H)


@pytest.mark.parametrize("sharding,calls", [("zero1", 1), ("zero2", 3)])
def test_zero_reduce_scatters_once_or_per_micro_batch(sharding, calls):
    """ZeRO-1 accumulates whole gradients and reduces once; ZeRO-2 keeps its shard only, so
    each of the 3 micro-batches' gradients is reduce-scattered."""
    from boom_ml.parallel.collectives import reduce_scatter_ms

    layout = Layout(dp=4, sharding=sharding, microbatches=3)
    out = step_time(_profile(), _shape(1), layout, [LAYERS], _groups(dp=4))
    (rs,) = [c for c in out["collectives"] if c["op"] == "reduce_scatter"]
    grads = 4 * (LAYERS * layer_params(1) + 2 * VOCAB * H + H)
    assert (rs["bytes"], rs["calls"]) == (grads, calls)
    assert rs["ms"] == pytest.approx(
        calls * reduce_scatter_ms(grads, _groups(dp=4)["dp"]), abs=1e-4
    )


def test_fsdp_gather_and_reduce_scatter_bytes():
    """FSDP2 per micro-batch (traced in test_parallel_traced.py): each layer unit gathered in
    forward and backward (checkpointing adds none), the root once; every unit reduce-scattered."""
    m = 3
    layout = Layout(dp=4, sharding="fsdp", microbatches=m)
    out = step_time(_profile(), _shape(1, checkpointing=True), layout, [LAYERS], _groups(dp=4))
    got = {(c["op"], c["what"].split()[0]): (c["bytes"], c["calls"]) for c in out["collectives"]}
    root = 2 * VOCAB * H + H
    assert got == {
        ("all_gather", "layer"): (4 * layer_params(1), 2 * LAYERS * m),
        ("all_gather", "root"): (4 * root, m),
        ("reduce_scatter", "layer"): (4 * layer_params(1), LAYERS * m),
        ("reduce_scatter", "root"): (4 * root, m),
    }
    # compute hides everything but each micro-batch's first gathers (the root's, then a
    # layer's) and the root's last reduce-scatter, which waits for the embedding's gradient
    from boom_ml.parallel.collectives import all_gather_ms, reduce_scatter_ms

    dp = _groups(dp=4)["dp"]
    first = m * (all_gather_ms(4 * root, dp) + all_gather_ms(4 * layer_params(1), dp))
    last = reduce_scatter_ms(4 * root, dp)
    assert sum(c["exposed_ms"] for c in out["collectives"]) == pytest.approx(first + last, abs=1e-3)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_tp_all_reduce_bytes(checkpointing):
    m = 2
    out = step_time(_profile(), _shape(2, checkpointing), Layout(tp=2, microbatches=m), [LAYERS],
                    _groups(tp=2))  # fmt: skip
    colls = [c for c in out["collectives"] if c["group"] == "tp" and "layer" in c["what"]]
    fwd, bwd = sorted(colls, key=lambda c: c["bytes"])
    assert fwd["bytes"] == 2 * 32 * H * 2  # batch x seq x hidden x fp16
    # PyTorch's checkpoint recomputes one of the two (traced in test_parallel_traced.py)
    assert fwd["calls"] == (3 if checkpointing else 2) * LAYERS * m
    assert bwd["bytes"] == 2 * 32 * H * 4  # activation gradients in the fp32 residual stream
    assert bwd["calls"] == 2 * LAYERS * m
    assert out["exposed_comm_ms"] == pytest.approx(out["comm_ms"])  # TP is on the critical path


def test_traced_tiny_model_counts_match_the_config():
    from boom_ml.parallel.profile import param_counts
    from boom_ml.specs import StepSpec

    counts = param_counts(SYNTHETIC_TINY_LLAMA, 2, StepSpec(batch_size=2, seq_len=32))
    assert counts["layers"] == layer_params(2)
    assert counts["first"] == VOCAB // 2 * H


@pytest.mark.parametrize(("recipe", "width"), [({"amp": "bf16"}, 4), ({"params_dtype": "bf16"}, 2)])
def test_pipeline_sends_carry_the_residual_stream(recipe, width):
    """A stage sends its last layer's output, the residual stream: autocast leaves it in the
    parameters' dtype (fp32 + a bf16 attention output is fp32), pure bf16 keeps it in bf16."""
    from boom_ml.gpus import get_gpu
    from boom_ml.parallel.predict import predict_raw
    from boom_ml.specs import StepSpec

    step = StepSpec(batch_size=2, seq_len=32, **recipe)
    out = predict_raw(SYNTHETIC_TINY_LLAMA, [get_gpu("h100-sxm")], step,
                      Layout(pp=2, microbatches=2), Cluster(), memory=False)  # fmt: skip
    sends = [c for c in out[0]["time"]["collectives"] if c["op"] == "send_recv"]
    hidden = SYNTHETIC_TINY_LLAMA["hidden_size"]
    assert sends and {c["bytes"] for c in sends} == {2 * 32 * hidden * width}


@pytest.mark.parametrize(("sharding", "gathers"), [("zero2", 1), ("fsdp", 4 + 1), ("zero3", 4 + 1)])
def test_fsdp_under_a_pipeline_reduces_each_unit_once(sharding, gathers):
    """torch.distributed.pipelining keeps FSDP2's units gathered after each backward and syncs
    no gradient before the stage's last backward, then reduces each unit once, with no compute
    left to hide it. zero2 (not resharded after forward) gathers a unit once a step; zero3 /
    fsdp reshard after each of the 4 forwards, the root too, so the next backward gathers again
    (m + 1; tests/test_parallel_traced.py runs torch's schedules)."""
    from boom_ml.parallel.collectives import all_gather_ms, reduce_scatter_ms

    layout = Layout(dp=4, pp=2, sharding=sharding, microbatches=4)
    out = step_time(_profile(), _shape(1), layout, [1, 1], _groups(dp=4, pp=2))
    worst = [c for c in out["collectives"] if c["group"] == "dp"]
    got = {(c["op"], c["what"].split()[0]): (c["bytes"], c["calls"]) for c in worst}
    last = out["critical_stage"] == 1  # the worst stage holds the head and final norm
    root = VOCAB * H + (H if last else 0)
    assert got == {
        ("all_gather", "layer"): (4 * layer_params(1), gathers),
        ("all_gather", "root"): (4 * root, gathers),
        ("reduce_scatter", "layer"): (4 * layer_params(1), 1),
        ("reduce_scatter", "root"): (4 * root, 1),
    }
    dp = _groups(dp=4)["dp"]
    reduces = reduce_scatter_ms(4 * layer_params(1), dp) + reduce_scatter_ms(4 * root, dp)
    first = all_gather_ms(4 * layer_params(1), dp) + all_gather_ms(4 * root, dp)
    exposed = sum(c["exposed_ms"] for c in worst)
    if sharding == "zero2":  # one layer a stage: its gather and the root's are the first ones
        assert exposed == pytest.approx(reduces + first, abs=1e-3)
    else:  # the backward's gathers hide behind compute, the reductions do not
        assert reduces + first <= exposed + 1e-6
        assert exposed < reduces + gathers * first
