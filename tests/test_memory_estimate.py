"""Memory model: multi-step replay, overhead terms, attribution, capacity search, plot.

The models are the synthetic ones of ``tiny_models.py`` and the GPUs are the packaged
ones with their memory shrunk where a test needs an OOM; no number here is a measurement.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest
from tiny_models import tiny_cnn, tiny_transformer

from boom_ml.batch_scaling import BatchScaling
from boom_ml.gpus import get_gpu
from boom_ml.gpus.spec import GpuSpec
from boom_ml.max_batch import BatchSearch, max_batch_size
from boom_ml.memory import estimate as memory_estimate
from boom_ml.memory.estimate import estimate_memory, simulate_step
from boom_ml.memory.live import live_peak
from boom_ml.memory.overheads import TABLE_PATH, load_overheads
from boom_ml.memory.replay import build_replay, resized
from boom_ml.specs import StepSpec
from boom_ml.trace.graph import OpGraph, canonical_free_order
from boom_ml.trace.step import trace_step

MiB = 1 << 20


def cnn(batch: int = 4, optimizer: str = "adamw", **kw) -> OpGraph:
    return trace_step(tiny_cnn(), StepSpec(batch, image_size=16, optimizer=optimizer, **kw))


def transformer(batch: int = 2, optimizer: str = "adamw", **kw) -> OpGraph:
    return trace_step(tiny_transformer(), StepSpec(batch, seq_len=16, optimizer=optimizer, **kw))


def shrunk(gpu_id: str, memory_bytes: int) -> GpuSpec:
    return dataclasses.replace(get_gpu(gpu_id), total_memory_bytes=memory_bytes)


@pytest.fixture(scope="module")
def graph() -> OpGraph:
    return transformer()


def test_replay_is_balanced_and_ids_are_unique(graph):
    replay = build_replay(graph, steps=3)
    live: set[int] = set()
    for alloc, block in zip(replay.is_alloc.tolist(), replay.block.tolist(), strict=True):
        if alloc:
            assert block not in live, f"block {block} allocated twice while alive"
            live.add(block)
        else:
            assert block in live, f"block {block} freed while not alive"
            live.remove(block)
    assert set(replay.step.tolist()) == {1, 2, 3}


def test_first_step_has_no_gradients_to_free_and_creates_state_lazily(graph):
    ev = graph.mem_events
    replay = build_replay(graph, steps=2, hold_outputs=False)
    phase = np.where(replay.src >= 0, ev["phase"].to_numpy()[np.maximum(replay.src, 0)], "")
    step1 = replay.step == 1
    assert not ((phase == "zero_grad") & step1 & ~replay.is_alloc).any()
    # AdamW state appears inside step 1, right before its first optimizer event.
    state = np.flatnonzero((phase == "optimizer_state") & step1)
    first_opt = np.flatnonzero((phase == "optimizer") & step1)[0]
    assert (
        len(state)
        and state.max() < first_opt
        and state.min() > np.flatnonzero(phase == "backward")[0]
    )
    # Step 2 frees exactly the gradients step 1 created.
    freed = replay.nbytes[(phase == "zero_grad") & (replay.step == 2)]
    grads = ev[(ev["category"] == "gradient") & (ev["phase"] == "backward")]["bytes"]
    assert Counter(freed.tolist()) == Counter(grads.tolist())


def test_a_peak_as_the_state_is_made_names_the_optimizer_step(graph):
    """Replayed where a first optimizer.step() makes it, the optimizer's state has no op of
    its own: a peak reached there is the optimizer's, not a phase named after a category."""
    from boom_ml.memory.attribution import LAZY_STATE_OP, attribute_peak

    replay = build_replay(graph, steps=2, hold_outputs=False)
    phase = graph.mem_events["phase"].to_numpy().astype(str)[np.maximum(replay.src, 0)]
    made = int(np.flatnonzero((phase == "optimizer_state") & (replay.src >= 0))[-1])
    att = attribute_peak(graph, replay, made, peak_reserved=0)
    assert (att.op, att.phase, att.step) == (LAZY_STATE_OP, "optimizer", 1)
    backward = int(np.flatnonzero(phase == "backward")[0])
    assert attribute_peak(graph, replay, backward, peak_reserved=0).phase == "backward"
    # Adagrad's state is made with the optimizer, before any step: not the step's
    adagrad = cnn(optimizer="adagrad")
    replay = build_replay(adagrad, steps=2, hold_outputs=False)
    phase = adagrad.mem_events["phase"].to_numpy().astype(str)[np.maximum(replay.src, 0)]
    made = int(np.flatnonzero((phase == "optimizer_state") & (replay.src >= 0))[-1])
    assert attribute_peak(adagrad, replay, made, peak_reserved=0).op != LAZY_STATE_OP


def test_adagrad_state_exists_before_the_first_step():
    g = cnn(optimizer="adagrad")
    replay = build_replay(g, steps=1)
    phase = g.mem_events["phase"].to_numpy()[np.maximum(replay.src, 0)]
    first_forward = np.flatnonzero(phase == "forward")[0]
    assert (phase[:first_forward] == "optimizer_state").any()


@pytest.mark.parametrize("optimizer,states", [("adagrad", 1), ("rmsprop", 1), ("adam", 2)])
def test_new_optimizers_trace_their_state(optimizer, states):
    g = cnn(optimizer=optimizer)
    ev = g.mem_events
    params = ev[ev["category"] == "parameter"]["bytes"].sum()
    state = ev[ev["category"] == "optimizer_state"]["bytes"].sum()
    buffers = 2 * 8 * 4 * 2 + 2 * 8  # BatchNorm running stats and counters are not state
    assert state == states * (params - buffers)
    assert (g.nodes["phase"] == "optimizer").any()


def test_held_outputs_die_after_the_next_forward(graph):
    ev = graph.mem_events
    logits = int(ev[(ev["phase"] == "loss") & (ev["action"] == "free")]["bytes"].max())
    held = simulate_step(graph, get_gpu("a100-80gb-sxm"), hold_outputs=True, capacity=False)
    dropped = simulate_step(graph, get_gpu("a100-80gb-sxm"), hold_outputs=False, capacity=False)
    assert held.result.peak_allocated >= dropped.result.peak_allocated
    assert held.result.peak_allocated - dropped.result.peak_allocated <= logits + 512


def test_estimate_adds_terms_and_breakdown_sums(graph):
    gpu = get_gpu("a100-80gb-sxm")
    est = estimate_memory(graph, gpu)
    live = live_peak(graph.mem_events).peak_bytes
    assert est.method == "allocator-sim"
    assert est.peak_reserved_bytes >= est.peak_allocated_bytes >= live
    outside = sum(v for k, v in est.overheads.items() if k in est.breakdown and k != "workspace")
    assert est.total_bytes == est.peak_reserved_bytes + outside
    assert sum(est.breakdown.values()) == est.total_bytes
    assert est.breakdown["workspace"] > 0 and est.breakdown["cuda_context"] > 0
    assert est.peak_op and est.peak_phase in ("forward", "loss", "backward", "optimizer")
    assert est.by_module and est.by_module[0]["bytes"] >= est.by_module[-1]["bytes"]
    assert est.fits and est.to_dict()["breakdown"] == est.breakdown


def test_the_reserved_peak_is_named_where_the_last_segment_was_added(graph):
    """A hunt read the allocated peak's op (an optimizer op) as where the reserved memory
    peaked; the reserved peak is reached when a segment is added, which the estimate names
    apart: the op of the first event at the replay's reserved maximum."""
    from boom_ml.memory.attribution import op_at

    gpu = get_gpu("a100-80gb-sxm")
    est = estimate_memory(graph, gpu)
    sm = simulate_step(graph, gpu)
    reserved = sm.result.timeline_reserved
    first = int(np.argmax(reserved))  # the first event at the maximum
    assert reserved[first] == est.peak_reserved_bytes == sm.result.peak_reserved
    assert first == sm.result.peak_index
    op, phase, _ = op_at(graph, sm.replay, first)
    assert (est.reserved_peak_op, est.reserved_peak_phase) == (op, phase) and op


def test_cublas_workspace_two_handles_sized_by_architecture(graph):
    table = load_overheads()
    small = table.allocator_extras(get_gpu("a100-80gb-sxm"), graph)
    big = table.allocator_extras(get_gpu("h100-sxm"), graph)
    assert [x.nbytes for x in small] == [4096 * 1024 * 2 + 16 * 1024 * 8] * 2
    assert [x.nbytes for x in big] == [32 * MiB] * 2
    assert all(x.persistent for x in small + big)


def test_the_cublas_term_says_it_holds_two_handles_workspaces(graph):
    est = estimate_memory(graph, get_gpu("a100-80gb-sxm"))
    term = next(t for t in est.terms if t["term"] == "cublas_workspace")
    assert term["bytes"] == 2 * (4096 * 1024 * 2 + 16 * 1024 * 8)
    assert term["source"].endswith("; x 2 handles (forward on the Python thread, backward on "
                                   "autograd's)")  # fmt: skip


def test_overhead_table_rows_name_their_source():
    table = load_overheads(TABLE_PATH)
    assert {t.term for t in table.terms} >= {"cuda_context", "cublas_workspace", "lazy_kernels"}
    for t in table.terms:
        kind = t.provenance.split(":")[0].split(" (")[0]
        assert kind in ("derived", "fitted", "measured by others", "bound", "assumption"), t


def test_oom_on_a_small_gpu(graph):
    need = estimate_memory(graph, get_gpu("a100-80gb-sxm")).total_bytes
    tiny = shrunk("a100-80gb-sxm", need - 1)
    est = estimate_memory(graph, tiny)
    assert not est.fits
    assert est.total_bytes >= need - 2 * MiB  # unbounded replay: what the step needs


def test_batch_scaling_is_exact_on_a_third_trace():
    g2, g4, g3 = cnn(2), cnn(4), cnn(3)
    scaling = BatchScaling(g2, 2, g4, 4)
    assert scaling.batch_dependent and scaling.matches(g3, 3)
    assert np.array_equal(scaling.graph_at(3).mem_events["bytes"], g3.mem_events["bytes"])
    with pytest.raises(ValueError):
        BatchScaling(g2, 2, transformer(), 4)


def test_loose_frees_are_in_block_order_so_amp_traces_scale():
    def free(block: int, phase: str, node: int = -1) -> dict:
        return {"action": "free", "block": block, "node_id": node, "phase": phase}

    alloc = {"action": "alloc", "block": 9, "node_id": 3, "phase": "forward"}
    events = [free(5, "a"), free(2, "a"), free(4, "b"), free(1, "b"), alloc, free(8, "b"),
              free(7, "b", node=3), free(6, "b", node=3)]  # fmt: skip
    # Runs of op-less frees of one phase are sorted; frees inside an op keep their order.
    assert [e["block"] for e in canonical_free_order(events)] == [2, 5, 1, 4, 9, 8, 7, 6]
    # Under AMP, autocast's weight copies die at its exit in hash order: with the canonical
    # order two batch sizes trace to one structure, and the max-batch search need not
    # trace every probe.
    g2, g4 = transformer(2, amp="bf16"), transformer(4, amp="bf16")
    assert BatchScaling(g2, 2, g4, 4).batch_dependent


def test_max_batch_size_is_the_boundary():
    def trace_at(b: int) -> OpGraph:
        return cnn(b)

    base = cnn(4)
    # the search is on the safe side: a batch fits when its p90 step does
    need8 = estimate_memory(cnn(8), get_gpu("a100-80gb-sxm")).p90_bytes
    gpu = shrunk("a100-80gb-sxm", need8 + 1)  # batch 8 fits, the answer is 8 or a bit more
    found = max_batch_size(base, gpu, trace_at=trace_at)
    assert found.batch_size >= 8 and found.scaled
    search = BatchSearch(base, 4, trace_at)
    assert search.fits(found.batch_size, gpu) and not search.fits(found.batch_size + 1, gpu)
    # The scaled answer agrees with real traces at the boundary.
    assert estimate_memory(cnn(found.batch_size), gpu).fits
    assert not estimate_memory(cnn(found.batch_size + 1), gpu).fits


def _copy(graph: OpGraph) -> OpGraph:
    """The same graph under another identity (no build of another graph is shared)."""
    return OpGraph(graph.nodes, graph.edges, graph.mem_events.copy(), dict(graph.meta))


@pytest.mark.parametrize(
    ("kw", "accumulate"), [({}, False), ({"zero_grad": "zero"}, False), ({}, True)]
)
def test_a_scaled_probe_reuses_the_template_build(kw, accumulate):
    """The search's scaled graphs replay the template's build with their own sizes swapped
    in, which must equal building them (cuDNN workspaces, in-place zero_grad and gradient
    accumulation included)."""
    scaling = BatchScaling(cnn(2, **kw), 2, cnn(4, **kw), 4)
    assert scaling.shares_build
    gpu = get_gpu("l4")
    for batch in (3, 37):
        scaled = scaling.graph_at(batch)
        assert memory_estimate._RESIZED.peek(scaled, ()) is not None  # the build is shared
        shared = simulate_step(scaled, gpu, capacity=False, accumulate=accumulate)
        built = simulate_step(_copy(scaled), gpu, capacity=False, accumulate=accumulate)
        for name in ("is_alloc", "block", "nbytes", "src", "step"):
            assert np.array_equal(getattr(shared.replay, name), getattr(built.replay, name))
        assert shared.result.peak_reserved == built.result.peak_reserved
    assert scaled.mem_events["bytes"].sum() > cnn(4, **kw).mem_events["bytes"].sum()


def test_a_gradient_that_grows_with_the_batch_is_built_anew():
    """Gradients are paired with their replacements by size when a replay is built: where
    a gradient's size moves with the batch, each scaled graph is built from its own sizes."""
    g2, g4 = cnn(2), cnn(4)
    grown = dataclasses.replace(g4, mem_events=g4.mem_events.copy())
    ev = grown.mem_events
    block = ev.loc[ev["phase"].eq("gradient"), "block"].iloc[0]
    ev.loc[ev["block"].eq(block), "bytes"] += 2 * 512  # every event of that gradient's block
    scaling = BatchScaling(g2, 2, grown, 4)
    assert not scaling.shares_build
    scaled = scaling.graph_at(9)
    assert memory_estimate._RESIZED.peek(scaled, ()) is None
    direct = build_replay(scaled, steps=3)
    # the template's build with these sizes swapped in pairs that gradient as the template
    # did, by its size at batch 2: another event list, which a shared build would replay
    swapped = resized(build_replay(scaling.template, steps=3), scaled.mem_events["bytes"])
    assert not np.array_equal(direct.block, swapped.block)
    replayed = simulate_step(scaled, get_gpu("l4"), capacity=False).replay.block
    assert np.array_equal(replayed[replayed >= 0], direct.block)  # workspaces (< 0) aside


def test_batch_one_scales_from_batches_two_and_four(tmp_path):
    """HF decoders trace another structure at batch 1 than at 2: the search from batch 1
    takes its affine model from batches 2 and 4 instead of tracing every probe."""
    import json

    from boom_ml.specs import ModelSpec
    from boom_ml.zoo import build_model
    from tests.tiny_models import tiny_llama_config

    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny_llama_config(vocab_size=1000)))
    traced: list[int] = []

    def trace_at(b: int) -> OpGraph:
        traced.append(b)
        return trace_step(build_model(ModelSpec(f"hf:{path}")), StepSpec(b, seq_len=32))

    base = trace_at(1)
    gpu = shrunk(
        "a100-80gb-sxm", estimate_memory(trace_at(16), gpu=get_gpu("a100-80gb-sxm")).p90_bytes
    )
    traced.clear()
    found = max_batch_size(base, gpu, trace_at=trace_at)
    assert found.scaled and sorted(traced) == [2, 4] and found.batch_size >= 15


def test_a_size_that_shrinks_with_the_batch_is_traced_not_scaled():
    """An event that shrinks as the batch grows (a MoE's per-expert buffers can) would go
    negative far out: the search traces from there on instead of losing its answer."""
    traced: list[int] = []

    def trace_at(b: int) -> OpGraph:
        traced.append(b)
        return cnn(b)

    g2, g4 = cnn(2), cnn(4)
    shrinking = dataclasses.replace(g4, mem_events=g4.mem_events.copy())
    first = shrinking.mem_events.index[0]
    shrinking.mem_events.loc[first, "bytes"] = g2.mem_events.loc[first, "bytes"] // 2
    search = BatchSearch(g2, 2, trace_at)
    search.traced[4] = shrinking
    search._scaling, search._scaling_tried = BatchScaling(g2, 2, shrinking, 4), True
    with pytest.raises(ValueError, match="negative event sizes"):
        search._scaling.graph_at(64)
    graph = search.graph_at(64)
    assert traced == [64] and search._scaling is None
    assert np.array_equal(graph.mem_events["bytes"], cnn(64).mem_events["bytes"])


def test_held_for_backward_is_what_the_forward_leaves() -> None:
    """Synthetic events: an activation and an autocast copy kept for backward (1000 and 600
    bytes, each rounded to 1024), a forward temporary and an activation freed before the
    backward starts, then backward's own blocks: the activation's 1024 bytes are held between
    the passes for each micro-batch (one autocast region caches the copy for all of them)."""
    import pandas as pd

    from boom_ml.memory.live import held_for_backward

    rows = [("alloc", 1, 1000, "activation", "forward"), ("alloc", 2, 600, "autocast_copy", "forward"),
            ("alloc", 3, 512, "temporary", "forward"), ("alloc", 4, 4096, "activation", "forward"),
            ("free", 3, 512, "temporary", "forward"), ("free", 4, 4096, "activation", "loss"),
            ("alloc", 5, 8192, "gradient", "backward"), ("free", 1, 1000, "activation", "backward")]  # fmt: skip
    events = pd.DataFrame(rows, columns=["action", "block", "bytes", "category", "phase"])
    assert held_for_backward(events) == 1024
    assert held_for_backward(events[events.phase != "backward"]) == 0  # no backward: none


def test_max_batch_is_never_below_a_batch_the_same_row_says_fits() -> None:
    """Near the capacity fit is not monotone in the batch (the allocator's segments): at
    22,500 resnet18 (64 px) fits an A100-40GB, 22,373 and 22,501 do not; the search from
    below stopped at 22,372, under the batch its own row said fits."""
    import boom_ml

    p = boom_ml.predict(model="torchvision:resnet18", gpu="a100-40gb-sxm", batch_size=22500,
                        image_size=64, advice=False)  # fmt: skip
    (g,) = p.gpus
    assert g.fits and g.memory.max_batch_size >= 22500


def test_a_buffer_replaced_in_forward_is_one_line(tmp_path) -> None:
    """A moving average assigned anew each forward (self.ema = ...) makes the replay free the
    first step's buffer twice: one line saying what to change (it was a BlockIdError
    traceback), still a BlockIdError for the allocator's own callers."""
    from zoo_helpers import linear_factory

    import boom_ml
    from boom_ml.errors import BoomError
    from boom_ml.memory.allocator import BlockIdError

    model = linear_factory(
        tmp_path,
        "self.ema = 0.9 * self.ema + 0.1 * x.detach().mean(0)\nreturn self.fc(x).sum()",
        init="self.register_buffer('ema', torch.zeros(8))",
    )
    with pytest.raises(BoomError) as err:
        boom_ml.predict(model=model, gpu="l4", batch_size=2)
    assert isinstance(err.value, BlockIdError) and "\n" not in str(err.value)
    assert str(err.value).endswith("update it in place (self.x.mul_(...), .copy_(...))")


def test_max_batch_finds_a_fit_above_the_first_failure() -> None:
    """vgg16 with Adam and eager module loading on an A100-40GB: near the limit the capped
    replays fit or not as the allocator's segments fall (481 is tight, its p10 and p90
    replays run out; 499 and 500 fit); a bisection stops below the first failure. The scan
    from the allocated-peak bound down finds a fitting batch above it. (Until the thirtieth
    session 396 had been tight too: a cuDNN workspace replayed before its convolution's
    output had made the output fail.)"""
    from boom_ml.stack import resolve_stack
    from boom_ml.zoo import build_model

    def trace_at(b: int) -> OpGraph:
        return trace_step(
            build_model("torchvision:vgg16"), StepSpec(batch_size=b, optimizer="adam")
        )

    gpu, stack = get_gpu("a100-40gb-sxm"), resolve_stack({"module_loading": "eager"})
    base = trace_at(128)
    found = max_batch_size(base, gpu, trace_at=trace_at, stack=stack)
    search = BatchSearch(base, 128, trace_at, stack=stack)
    assert found.scaled and search.fits(396, gpu) and not search.fits(481, gpu)
    assert found.batch_size >= 499 and search.fits(found.batch_size, gpu)
    bound = search._allocated_bound(gpu)
    assert bound is not None and found.batch_size <= bound


def _history(peaks: list[int]) -> tuple:
    """A replay of len(peaks) steps, two events each, whose reserved bytes reach each peak."""
    steps = np.repeat(np.arange(1, len(peaks) + 1), 2)
    replay = dataclasses.make_dataclass("R", ["step"])(steps)
    result = dataclasses.make_dataclass("A", ["timeline_reserved"])(np.repeat(peaks, 2))
    return replay, result


@pytest.mark.parametrize(
    ("peaks", "growing"),
    [
        ([36, 52, 52], True),  # one comparison so far: a fourth step
        ([36, 52, 52, 56], True),  # the H100's Llama-3.2-1B grad_accum=2 history
        ([36, 52, 52, 56, 56], True),
        ([36, 52, 52, 56, 56, 56], False),  # held for two steps
        ([36, 52, 56, 56], True),  # the A100's, which then holds
        ([36, 52, 56, 56, 56], False),
        ([36, 52], False),  # fewer steps asked for: nothing to compare
    ],
)
def test_a_replay_under_accumulation_runs_until_its_peak_holds_two_steps(peaks, growing):
    assert memory_estimate.still_growing(*_history(peaks)) is growing


def test_accumulation_replays_as_many_steps_as_its_peak_needs():
    """The replay under accumulation ends where its reserved peak has held for two steps: its
    peak is that of a replay of MAX_STEPS steps; without accumulation three steps, as before."""
    from boom_ml.memory.replay import MAX_STEPS

    graph, gpu = transformer(4), get_gpu("a100-80gb-sxm")
    grown = simulate_step(graph, gpu, capacity=False, accumulate=True)
    longest = simulate_step(graph, gpu, capacity=False, accumulate=True, steps=MAX_STEPS)
    assert 4 <= grown.replay.step.max() < MAX_STEPS
    assert grown.result.peak_reserved == longest.result.peak_reserved
    assert simulate_step(graph, gpu, capacity=False).replay.step.max() == 3
