"""Memory terms outside the traced tensors, the software stack, usable capacity, the
p10/p90 verdict and gradient accumulation.

Models are the synthetic ones of ``tiny_models.py``; no number here is a measurement.
Exact values come from the rules the code implements (threads per SM x SMs x stack size,
PyTorch's cuBLAS workspace defaults, the bytes a convolution reads and writes).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import tiny_cnn, tiny_transformer

from boom_ml.errors import InvalidInputError
from boom_ml.gpus import all_gpus, get_gpu
from boom_ml.memory.allocator import simulate
from boom_ml.memory.estimate import estimate_memory, simulate_step
from boom_ml.memory.overheads import load_overheads
from boom_ml.memory.replay import build_replay
from boom_ml.specs import StepSpec
from boom_ml.stack import cuda_tag, installed_torch, resolve_optimizer_impl, resolve_stack
from boom_ml.trace.graph import OpGraph
from boom_ml.trace.step import trace_step

MiB = 1 << 20


@pytest.fixture(scope="module")
def transformer() -> OpGraph:
    return trace_step(tiny_transformer(), StepSpec(2, seq_len=16))


@pytest.fixture(scope="module")
def cnn() -> OpGraph:
    return trace_step(tiny_cnn(), StepSpec(4, image_size=16))


def test_local_memory_is_thread_slots_times_stack_size(transformer):
    table, stack = load_overheads(), resolve_stack()
    a100 = table.outside_allocator(get_gpu("a100-40gb-sxm"), transformer, stack)
    rtx = table.outside_allocator(get_gpu("rtx-3060"), transformer, stack)
    assert a100["local_memory"] == 108 * 2048 * 1024  # sm_80: 2048 threads per SM
    assert rtx["local_memory"] == 28 * 1536 * 1024  # sm_86: 1536 threads per SM
    assert a100["printf_fifo"] == 1 << 20 and a100["malloc_heap"] == 8 << 20


def test_two_architectures_differ_by_the_modelled_terms_exactly(transformer):
    """Same step on an A100 (108 SMs, sm_80) and an H100 SXM (132 SMs, sm_90): the outside
    terms differ by the local memory, the allocated peak by the two cuBLAS workspaces."""
    a100 = simulate_step(transformer, get_gpu("a100-80gb-sxm"), capacity=False)
    h100 = simulate_step(transformer, get_gpu("h100-sxm"), capacity=False)
    assert h100.outside_total - a100.outside_total == (132 - 108) * 2048 * 1024
    workspace = 2 * (32 * MiB - (4096 * 1024 * 2 + 16 * 1024 * 8))  # two handles
    assert h100.result.peak_allocated - a100.result.peak_allocated == workspace


def test_convolution_workspace_events(cnn):
    """p90: one optional workspace per convolution kernel, of the bytes it reads and writes,
    allocated once the kernel's outputs are (PyTorch's cuDNN calls take them allocated and
    allocate the workspace inside) and freed at once; p10 and p50 add none."""
    table, gpu, stack = load_overheads(), get_gpu("a100-80gb-sxm"), resolve_stack()
    conv = cnn.nodes[cnn.nodes["family"] == "conv"]
    extras = [x for x in table.allocator_extras(gpu, cnn, stack, "p90") if not x.persistent]
    expected = (conv["bytes_read"] + conv["bytes_written"]).tolist()
    assert sorted(x.nbytes for x in extras) == sorted(expected)
    assert all(x.optional for x in extras)
    ev = cnn.mem_events
    ev_nodes, allocs = ev["node_id"].to_numpy(), (ev["action"] == "alloc").to_numpy()
    for x in extras:
        node = ev_nodes[x.alloc_before]
        assert x.alloc_after_row and x.free_after == x.alloc_before
        assert x.alloc_before == int(np.flatnonzero((ev_nodes == node) & allocs)[-1])
    # in the replay, each workspace follows its kernel's output and nothing comes between
    replay = build_replay(cnn, extras=extras)
    made = np.flatnonzero(np.isin(replay.block, list(replay.synthetic)) & replay.is_alloc)
    assert len(made) == len(extras) * 3  # three steps
    assert all(replay.src[i - 1] >= 0 and replay.is_alloc[i - 1] for i in made)
    assert all(replay.block[i + 1] == replay.block[i] and not replay.is_alloc[i + 1] for i in made)
    for level in ("p10", "p50"):
        assert not [x for x in table.allocator_extras(gpu, cnn, stack, level) if not x.persistent]


def test_workspace_that_does_not_fit_is_dropped_not_an_oom():
    """PyTorch falls back to another engine when a cuDNN workspace cannot be allocated: an
    optional block that does not fit is skipped (and its free too), anything else OOMs."""
    events = [("alloc", 1, 10 * MiB), ("alloc", 2, 100 * MiB), ("free", 2, 100 * MiB),
              ("alloc", 3, 4 * MiB)]  # fmt: skip
    dropped = simulate(events, 40 * MiB, optional={2})
    assert not dropped.oom and dropped.peak_allocated == 14 * MiB
    assert simulate(events, 40 * MiB).oom
    assert simulate(events, None, optional={2}).peak_allocated == 110 * MiB


def test_verdict_yes_tight_no(cnn):
    gpu = get_gpu("a100-80gb-sxm")
    est = estimate_memory(cnn, gpu)
    assert est.p10_bytes <= est.total_bytes <= est.p90_bytes and est.p10_bytes < est.p90_bytes
    assert (
        est.fit == "yes" and est.fits and est.headroom_bytes == est.capacity_bytes - est.total_bytes
    )

    def verdict(capacity: int) -> tuple[str, bool]:
        e = estimate_memory(cnn, dataclasses.replace(gpu, total_memory_bytes=capacity))
        return e.fit, e.fits

    assert verdict(est.p90_bytes) == ("yes", True)
    # Between the bounds: the p10 step fits (its workspaces can be dropped), p90's context does not.
    assert verdict((est.p10_bytes + est.p90_bytes) // 2) == ("tight", False)
    assert verdict(est.p10_bytes // 2) == ("no", False)


def test_eager_module_loading_adds_kernel_images(transformer):
    gpu = get_gpu("a100-80gb-sxm")
    lazy = estimate_memory(transformer, gpu, stack=resolve_stack({"module_loading": "lazy"}))
    eager = estimate_memory(transformer, gpu, stack=resolve_stack({"module_loading": "eager"}))
    assert eager.total_bytes - lazy.total_bytes == 712952320  # eager_kernels p50 row
    assert "eager_kernels" in eager.breakdown and "lazy_kernels" in lazy.breakdown


@settings(max_examples=12, deadline=None)
@given(
    gpu=st.sampled_from([g.id for g in all_gpus()]),
    loading=st.sampled_from(["lazy", "eager"]),
    level=st.sampled_from(["p10", "p50", "p90"]),
)
def test_total_reserved_allocated_order_and_eager_never_below_lazy(cnn, gpu, loading, level):
    spec = get_gpu(gpu)
    sm = simulate_step(cnn, spec, stack=resolve_stack({"module_loading": loading}),
                       level=level, capacity=False)  # fmt: skip
    assert sm.total >= sm.result.peak_reserved >= sm.result.peak_allocated
    lazy = simulate_step(cnn, spec, stack=resolve_stack({"module_loading": "lazy"}),
                         level=level, capacity=False)  # fmt: skip
    assert sm.total >= lazy.total


def live_at_second_forward(graph: OpGraph, accumulate: bool = False) -> int:
    """Bytes the replay holds when the second step's forward starts."""
    ev = graph.mem_events
    replay = build_replay(graph, steps=2, hold_outputs=False, accumulate=accumulate)
    phase = np.where(replay.src >= 0, ev["phase"].to_numpy()[np.maximum(replay.src, 0)], "")
    first = int(np.flatnonzero((phase == "forward") & (replay.step == 2))[0])
    live: dict[int, int] = {}
    for a, b, n in zip(replay.is_alloc[:first], replay.block[:first],
                       replay.nbytes[:first], strict=True):  # fmt: skip
        if a:
            live[int(b)] = int(n)
        else:
            live.pop(int(b), None)
    return sum(live.values())


def test_gradients_stay_alive_between_micro_batches(transformer):
    ev = transformer.mem_events
    grads = int(ev[(ev["category"] == "gradient") & (ev["action"] == "alloc")
                   & (ev["phase"] == "backward")]["bytes"].sum())  # fmt: skip
    assert grads > 0

    assert (live_at_second_forward(transformer, accumulate=True)
            - live_at_second_forward(transformer) == grads)  # fmt: skip
    gpu = get_gpu("a100-80gb-sxm")
    one = estimate_memory(transformer, gpu)
    accum = estimate_memory(transformer, gpu, grad_accum=4)
    assert accum.peak_allocated_bytes >= one.peak_allocated_bytes


def test_stack_defaults_and_errors():
    release, cuda = installed_torch()
    stack = resolve_stack()
    assert stack.torch == ".".join(release.split(".")[:2])
    # a wheel from PyPI has no +cuXXX in its metadata (download.pytorch.org's have one): then
    # the release's PyPI default, CUDA 13.0 for torch 2.14 (its wheel's torch.version.cuda)
    assert stack.cuda == (cuda or "13.0")
    assert (cuda_tag("cu130"), cuda_tag("cu124"), cuda_tag("cpu")) == ("13.0", "12.4", None)
    assert stack.module_loading == "lazy" and not stack.cudnn_benchmark
    old = resolve_stack({"torch": "1.12"})
    assert old.module_loading == "eager"  # PyTorch sets lazy loading from 1.13 on
    assert resolve_stack({"torch": "2.6"}).cuda == "12.4"  # the PyPI default of 2.6
    with pytest.raises(InvalidInputError, match="unknown stack.torch"):
        resolve_stack({"torch": "3.1"})
    with pytest.raises(InvalidInputError, match="not released for CUDA"):
        resolve_stack({"torch": "2.6", "cuda": "13.0"})
    with pytest.raises(InvalidInputError, match="module_loading"):
        resolve_stack({"module_loading": "sometimes"})
    with pytest.raises(InvalidInputError, match="unknown stack option"):
        resolve_stack({"pytorch": "2.6"})
    with pytest.raises(InvalidInputError, match=r"lazy needs CUDA >= 11\.7 .* has CUDA 11\.3"):
        resolve_stack({"torch": "1.12", "cuda": "11.3", "module_loading": "lazy"})
    with pytest.raises(InvalidInputError, match=r"expandable_segments needs torch >= 2\.1"):
        resolve_stack({"torch": "2.0", "expandable_segments": True})
    assert resolve_stack({"torch": "2.1", "expandable_segments": True}).expandable_segments
    # a wheel loads its own cuDNN major: a newer minor of it, not another major
    with pytest.raises(InvalidInputError, match=r"built against cuDNN 8 .* another major"):
        resolve_stack({"torch": "2.1", "cudnn": "9.24.0.43"})
    assert resolve_stack({"torch": "2.6", "cudnn": "9.24.0.43"}).cudnn == "9.24.0.43"


def test_optimizer_implementation_follows_the_stack():
    new, old = resolve_stack({"torch": "2.6"}), resolve_stack({"torch": "1.13"})
    assert resolve_optimizer_impl("adamw", "auto", new) == "foreach"
    assert resolve_optimizer_impl("adafactor", "auto", new) == "loop"  # Adafactor opts out
    assert resolve_optimizer_impl("adamw", "auto", old) == "loop"
    assert resolve_optimizer_impl("adamw", "fused", new) == "fused"
    with pytest.raises(InvalidInputError, match="no fused"):
        resolve_optimizer_impl("adafactor", "fused", new)
    # an optimizer named after its kernels runs them: another implementation is refused
    assert resolve_optimizer_impl("adamw-fused", "fused", new) == "fused"
    assert resolve_optimizer_impl("adamw8bit", "loop", new) == "loop"
    for name, impl in (
        ("adamw-fused", "foreach"),
        ("adamw8bit", "foreach"),
        ("adamw8bit", "fused"),
    ):
        with pytest.raises(InvalidInputError, match=f"{name}' runs only its"):
            resolve_optimizer_impl(name, impl, new)


@pytest.mark.parametrize(
    "optimizer,impl,first",
    [("adafactor", "auto", "2.5"), ("adam", "fused", "1.13"), ("adamw", "fused", "2.0"),
     ("adamw-fused", "auto", "2.0"), ("sgd", "fused", "2.3"), ("sgd-momentum", "fused", "2.3")],
)  # fmt: skip
def test_what_a_release_lacks_is_refused(optimizer, impl, first):
    """An optimizer or fused kernel from a later PyTorch than the stack's is one line; the
    release that brought it takes it."""
    major, minor = map(int, first.split("."))
    before = f"{major}.{minor - 1}" if minor else "1.13"  # the release before 2.0 is 1.13
    with pytest.raises(InvalidInputError, match=f"new in (PyTorch )?{re.escape(first)}"):
        resolve_optimizer_impl(optimizer, impl, resolve_stack({"torch": before}))
    assert resolve_optimizer_impl(optimizer, impl, resolve_stack({"torch": first})) in (
        "fused", "loop")  # fmt: skip


def test_adafactor_loop_has_no_parameter_sized_temporaries():
    """The for-loop Adafactor (PyTorch's default) needs no foreach temporaries over all
    parameters at once: its optimizer-phase peak is below the foreach one."""
    graphs = {
        impl: trace_step(tiny_transformer(), StepSpec(2, seq_len=16, optimizer="adafactor",
                                                      optimizer_impl=impl))
        for impl in ("loop", "foreach")
    }  # fmt: skip
    assert graphs["loop"].meta["step"]["optimizer_impl"] == "loop"
    opt_ops = {k: set(g.nodes[g.nodes["phase"] == "optimizer"]["op"]) for k, g in graphs.items()}
    assert not any(o.startswith("_foreach") for o in opt_ops["loop"])
    assert any(o.startswith("_foreach") for o in opt_ops["foreach"])
    gpu = get_gpu("a100-80gb-sxm")
    peaks = {k: estimate_memory(g, gpu).peak_allocated_bytes for k, g in graphs.items()}
    assert peaks["loop"] < peaks["foreach"]
    auto = trace_step(tiny_transformer(), StepSpec(2, seq_len=16, optimizer="adafactor"))
    assert auto.meta["step"]["optimizer_impl"] == "loop"


def test_every_gpu_has_a_sourced_usable_capacity():
    for gpu in all_gpus():
        assert gpu.total_memory_bytes, gpu.id
        assert gpu.capacity_source.split(":")[0] in ("reported", "derived"), gpu.id
        # what the driver hands out never exceeds the memory on the card (+1 %: the
        # datasheet's GB may be decimal on some cards)
        assert gpu.capacity_bytes <= gpu.memory_gb * 2**30 * 1.01, gpu.id


def test_kept_gradients_are_alive_when_the_forward_starts():
    """zero_grad=zero: every gradient is allocated before the first forward of step 2, and
    counted once (set_to_none frees them at the loop head)."""
    spec = StepSpec(batch_size=2, optimizer="none")
    graphs = {z: trace_step(tiny_transformer(), dataclasses.replace(spec, zero_grad=z))
              for z in ("set_to_none", "zero")}  # fmt: skip
    param_bytes = sum(p.numel() * 4 for p in tiny_transformer().module.parameters())

    kept, freed = (live_at_second_forward(graphs[z]) for z in ("zero", "set_to_none"))
    assert kept - freed == param_bytes
    gpu = get_gpu("a100-80gb-sxm")
    assert (estimate_memory(graphs["zero"], gpu).peak_allocated_bytes
            >= estimate_memory(graphs["set_to_none"], gpu).peak_allocated_bytes)  # fmt: skip


@pytest.mark.parametrize("impl,host", [("foreach", True), ("fused", False)])
def test_adam_step_counts_are_host_tensors_unless_fused(impl, host):
    """torch.optim's Adam keeps its step counts on the CPU unless fused or capturable, when
    they are made on the parameter's device: one 4-byte float each."""
    graph = trace_step(tiny_transformer(), StepSpec(batch_size=2, optimizer="adamw",
                                                    optimizer_impl=impl))  # fmt: skip
    params = len(list(tiny_transformer().module.parameters()))
    on_host = graph.meta["recipe"]["bytes"]["optimizer_state_on_host"]
    assert on_host == (4 * params if host else 0)
