"""Memory of one training step on one GPU, from the traced OpGraph.

The traced step's alloc/free events are replayed through the caching-allocator
simulator over several consecutive steps of a training loop (``replay.py``), because
what ``nvidia-smi`` shows at the peak is the allocator's *reserved* memory, and that
depends on history: the first step creates the optimizer state in the middle of the
optimizer phase and segments carved then are reused (or not) later. On top of the
reserved peak come the terms outside the allocator (CUDA context, local memory, kernel
images), see ``overheads.py``.

Each estimate is made at three levels: p50 with the central value of every term, p10 and
p90 with the bounds of what cannot be derived (context size, cuDNN workspaces). The
verdict is ``yes`` when the step fits the GPU's usable memory at every level, ``no`` when
at none, and ``tight`` otherwise (near the limit the allocator's fragmentation is not
monotone in the bytes asked, so the p90 replay may fit where the p50 one does not).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from boom_ml.estimates import MemoryEstimate
from boom_ml.gpus.spec import GpuSpec
from boom_ml.identity_cache import IdentityCache
from boom_ml.memory.allocator import AllocatorConfig, AllocatorResult, simulate
from boom_ml.memory.attribution import attribute_peak, op_at
from boom_ml.memory.overheads import Amount, Extra, OverheadTable, Term, load_overheads
from boom_ml.memory.replay import (
    DEFAULT_STEPS,
    MAX_STEPS,
    Replay,
    build_replay,
    event_phases,
    resized,
    with_extra_sizes,
)
from boom_ml.stack import Stack, resolve_stack
from boom_ml.trace.graph import OpGraph

__all__ = [
    "DEFAULT_STEPS",
    "StepMemory",
    "WindowPeak",
    "estimate_memory",
    "simulate_step",
    "step_fits",
    "window_peaks",
]


@dataclass
class StepMemory:
    """Everything one replay computed: the events, the allocator's answer, the terms."""

    replay: Replay
    result: AllocatorResult
    outside: list[Amount]  # terms outside the allocator (context, kernels, ...)
    inside_bytes: dict[str, int]  # terms inside it (workspaces), largest live value
    allocator_capacity: int

    @property
    def outside_bytes(self) -> dict[str, int]:
        return {a.term: a.nbytes for a in self.outside}

    @property
    def outside_total(self) -> int:
        return sum(a.nbytes for a in self.outside)

    @property
    def total(self) -> int:
        """What nvidia-smi would show at the peak: reserved plus everything outside."""
        return self.result.peak_reserved + self.outside_total


def allocator_config_of(stack: Stack) -> AllocatorConfig | None:
    """The ``PYTORCH_CUDA_ALLOC_CONF`` options the stack sets (None: PyTorch's defaults)."""
    if not stack.expandable_segments and stack.max_split_size_mb is None:
        return None
    return AllocatorConfig(
        max_split_size_mb=stack.max_split_size_mb, expandable_segments=stack.expandable_segments
    )


# Replays of recent graphs. A replay depends on the GPU only through the overhead terms
# (workspace sizes per architecture, context) and the capacity, so the GPUs of one
# prediction mostly share one replay.
_REPLAYS: IdentityCache[StepMemory] = IdentityCache(32)
_ATTRIBUTIONS: IdentityCache[Any] = IdentityCache(32)  # per replay: what is alive at its peak
# Built event lists, keyed by the extras less their sizes: GPUs whose workspaces differ only
# in bytes (another architecture or level) and the capped replays share one build (a Python
# loop over every event of three steps), and each fills in its own sizes.
_BUILDS: IdentityCache[Replay] = IdentityCache(32)
# Graphs whose events are another graph's with other sizes (the batch search's scaled
# graphs, ``batch_scaling.BatchScaling``): graph -> (that graph, the sizes). Their builds are the
# other graph's with the sizes swapped in, not a Python loop over three steps' events each.
_RESIZED: IdentityCache[tuple[OpGraph, np.ndarray]] = IdentityCache(32)


def share_build(graph: OpGraph, template: OpGraph, sizes: np.ndarray) -> None:
    """Record that ``graph``'s events are ``template``'s with ``sizes`` (the caller has
    checked ``replay.sizes_only_change``), so that its replays reuse ``template``'s builds."""
    _RESIZED.get(graph, (), lambda: (template, sizes))


def _built_replay(
    graph: OpGraph, steps: int, hold_outputs: bool, extras: list[Extra], accumulate: bool
) -> Replay:
    """``build_replay(graph, steps, hold_outputs, extras, accumulate)``, shared."""
    shapes = [replace(x, nbytes=0) for x in extras]
    key = (steps, hold_outputs, accumulate, tuple(shapes))
    origin = _RESIZED.peek(graph, ())
    if origin is not None:
        template, sizes = origin
        built = _BUILDS.get(
            template, key, lambda: build_replay(template, steps, hold_outputs, shapes, accumulate)
        )
        return with_extra_sizes(resized(built, sizes), extras)
    built = _BUILDS.get(
        graph, key, lambda: build_replay(graph, steps, hold_outputs, shapes, accumulate)
    )
    return with_extra_sizes(built, extras)


def simulate_step(
    graph: OpGraph,
    gpu: GpuSpec,
    *,
    stack: Stack | None = None,
    level: str = "p50",
    allocator_config: AllocatorConfig | None = None,
    steps: int = DEFAULT_STEPS,
    hold_outputs: bool = True,
    table: OverheadTable | None = None,
    capacity: bool = True,
    accumulate: bool = False,
) -> StepMemory:
    """Replay ``steps`` training steps on ``gpu``: peaks, OOM and the overhead terms.

    ``level`` picks the p10 / p50 / p90 value of each term. With ``capacity=False`` the
    allocator may grow without limit (what the step would need on a larger device with
    the same overheads). ``accumulate``: gradients survive from one step to the next
    (gradient accumulation). The allocator options default to the stack's.
    """
    stack = stack if stack is not None else resolve_stack()
    table = table if table is not None else load_overheads()
    config = allocator_config if allocator_config is not None else allocator_config_of(stack)
    outside = table.outside(gpu, graph, stack, level)
    extras = table.allocator_extras(gpu, graph, stack, level)
    limit = max(int(gpu.capacity_bytes) - sum(a.nbytes for a in outside), 0)
    # The terms outside the allocator do not change the replay, only its limit: GPUs that
    # share the workspaces (one architecture major) share the unbounded replay.
    key = (
        id(table),
        config,
        steps,
        hold_outputs,
        accumulate,
        tuple(extras),
        limit if capacity else None,
    )

    def replay_step() -> StepMemory:
        n = steps
        while True:
            replay = _built_replay(graph, n, hold_outputs, extras, accumulate)
            result = simulate(replay, limit if capacity else None, config,
                              optional=replay.optional)  # fmt: skip
            if not accumulate or result.oom or n >= MAX_STEPS or not still_growing(replay, result):
                break
            n += 1
        inside: dict[str, int] = {}
        for x in extras:  # persistent buffers add up; transient ones count by the largest
            name = "cublas_workspace" if x.persistent else "cudnn_workspace"
            old = inside.get(name, 0)
            inside[name] = old + x.nbytes if x.persistent else max(old, x.nbytes)
        return StepMemory(replay, result, [], inside, limit)

    shared = _REPLAYS.get(graph, key, replay_step)
    return replace(shared, outside=outside, allocator_capacity=limit)


def still_growing(replay: Replay, result: AllocatorResult) -> bool:
    """Under gradient accumulation: whether the reserved peak rose in either of the last two
    replayed steps, so the loop may not have reached its steady state. The kept gradients
    shift the free blocks from one micro-batch to the next, and a cached block can be split
    by small requests one step later on one GPU than on another (their workspace sizes
    differ): Llama-3.2-1B at 4 x 2048 with grad_accum=2 reserved 36.6, 52.4, 52.4 and then
    56.4 GiB in steps 1-4 on an H100 (56.3 from step 3 on an A100), which three steps read
    as 52.4. Step 1 creates the optimizer state and counts for neither comparison."""
    last = int(replay.step.max()) if len(replay.step) else 0
    if last < 3 or len(result.timeline_reserved) != len(replay.step):
        return False  # fewer steps asked for, or a replay cut short
    if last == 3:
        return True  # one comparison (steps 2 and 3) so far: replay a fourth
    reserved = result.timeline_reserved
    peaks = [reserved[replay.step == k].max() for k in (last - 2, last - 1, last)]
    return bool(peaks[2] > peaks[1] or peaks[1] > peaks[0])


def step_fits(graph: OpGraph, gpu: GpuSpec, **kwargs: object) -> tuple[bool, StepMemory]:
    """Whether the step runs on ``gpu`` without OOM, and the replay that says so.

    The unbounded replay (shared by GPUs with the same overheads) is the answer whenever
    it stays within the GPU (a capped replay would be identical) or when even its
    allocated peak does not fit and nothing in it is optional (a capped replay must
    fail); in between, the capped replay decides, since the allocator frees its cache
    and retries before an OOM and PyTorch drops a cuDNN workspace it cannot allocate.
    """
    kwargs.pop("capacity", None)
    cap = gpu.capacity_bytes
    sm = simulate_step(graph, gpu, capacity=False, **kwargs)  # type: ignore[arg-type]
    if sm.total <= cap:
        return True, sm
    if sm.result.peak_allocated + sm.outside_total > cap and not sm.replay.optional:
        return False, sm
    capped = simulate_step(graph, gpu, capacity=True, **kwargs)  # type: ignore[arg-type]
    ok = not capped.result.oom and capped.total <= cap
    return ok, (capped if ok else sm)


def estimate_memory(
    graph: OpGraph,
    gpu: GpuSpec,
    stack: Stack | None = None,
    allocator_config: AllocatorConfig | None = None,
    steps: int = DEFAULT_STEPS,
    hold_outputs: bool = True,
    table: OverheadTable | None = None,
    top_modules: int = 10,
    grad_accum: int = 1,
) -> MemoryEstimate:
    """Peak memory of the step on ``gpu`` (as nvidia-smi shows it), its p10-p90 range and
    the verdict.

    When the step runs out of memory, the peaks are those of an unbounded replay (what
    the step would need). With ``grad_accum`` > 1 the gradients stay alive between
    micro-batches.
    """
    stack = stack if stack is not None else resolve_stack()
    table = table if table is not None else load_overheads()
    common = dict(
        stack=stack, allocator_config=allocator_config, steps=steps, hold_outputs=hold_outputs,
        table=table, accumulate=grad_accum > 1,
    )  # fmt: skip
    levels = {lv: step_fits(graph, gpu, level=lv, **common) for lv in ("p10", "p50", "p90")}
    _, sm = levels["p50"]
    res = sm.result
    # Attribute at the peak of allocated bytes: the reserved peak is first reached when a
    # segment is added, often for a small request while most cached bytes are free.
    at = int(np.argmax(res.timeline_allocated)) if len(res.timeline_allocated) else -1
    # the same for every GPU that shares this replay
    att = _ATTRIBUTIONS.get(
        sm.replay,
        (id(graph), at, res.peak_reserved, top_modules),
        lambda: attribute_peak(graph, sm.replay, at, res.peak_reserved, top_modules),
    )
    grew = op_at(graph, sm.replay, res.peak_index) if res.peak_index >= 0 else ("", "", "")
    cap = int(gpu.capacity_bytes)
    # yes only when every level fits: the allocator's fragmentation does not always grow with
    # the bytes asked (a p90 replay with cuDNN workspaces can pack into fewer segments than
    # the p50 one without), so one level's verdict does not bound the others'
    fitting = [ok for ok, _ in levels.values()]
    fit = "yes" if all(fitting) else ("tight" if any(fitting) else "no")
    totals = [level.total for _, level in levels.values()]
    terms = [
        {"term": a.term, "library": a.library, "bytes": a.nbytes, "where": "outside allocator",
         "source": a.provenance}
        for a in sm.outside
    ] + [
        {"term": t.term, "library": t.library, "bytes": sm.inside_bytes.get(t.term, 0),
         "where": "caching allocator", "source": t.provenance + _copies(t, sm.inside_bytes)}
        for t in table.inside(gpu, graph, stack, "p50")
    ]  # fmt: skip
    return MemoryEstimate(
        peak_allocated_bytes=res.peak_allocated,
        peak_reserved_bytes=res.peak_reserved,
        total_bytes=sm.total,
        capacity_bytes=cap,
        fits=fit == "yes",
        method="allocator-sim",
        breakdown={**att.by_category, **sm.outside_bytes},
        overheads={**sm.outside_bytes, **sm.inside_bytes},
        peak_op=att.op,
        peak_phase=att.phase,
        reserved_peak_op=grew[0],
        reserved_peak_phase=grew[1],
        fragmentation=res.fragmentation,
        by_module=att.by_module,
        by_module_group=att.by_module_group,
        peak_module=att.module,
        p10_bytes=min(totals),
        p90_bytes=max(totals),
        fit=fit,
        headroom_bytes=cap - sm.total,
        stack=stack.to_dict(),
        terms=terms,
        capacity_source=gpu.capacity_source,
        temporary_by_phase=dict(att.temporary_by_phase),
    )


# (allocated bytes at a window's peak, what holds them: a PeakAttribution); (0, None) where
# the step has no event in the window
WindowPeak = tuple[int, Any]


def window_peaks(
    graph: OpGraph, gpu: GpuSpec, windows: dict[str, tuple[str, ...]],
    stack: Stack | None = None, grad_accum: int = 1, top_n: int = 10,
) -> dict[str, WindowPeak]:  # fmt: skip
    """The peak of allocated bytes inside each window (a name → the phases it spans; an
    empty tuple: every phase no other window names) of the p50 replay
    :func:`estimate_memory` makes (the same replay, shared: asked after it, this costs the
    attribution only).

    A step's peak moves between its parts as a model grows: the 1- and 2-layer models a
    multi-GPU profile traces may peak in the backward pass where the whole model peaks in
    the optimizer step, whose memory grows with the parameters; and two small models can
    peak at different moments of one pass. Extrapolating each window on its own and taking
    the largest keeps that peak (``parallel/memory_profile.py``).
    """
    stack = stack if stack is not None else resolve_stack()
    _, sm = step_fits(graph, gpu, level="p50", stack=stack, table=load_overheads(),
                      accumulate=grad_accum > 1)  # fmt: skip
    key = (id(graph), tuple((k, v) for k, v in windows.items()), top_n)
    # the same for every GPU that shares this replay
    return _WINDOWS.get(sm.replay, key, lambda: _window_peaks(graph, sm, windows, top_n))


_WINDOWS: IdentityCache[dict[str, WindowPeak]] = IdentityCache(32)


def _window_peaks(
    graph: OpGraph, sm: StepMemory, windows: dict[str, tuple[str, ...]], top_n: int
) -> dict[str, WindowPeak]:
    res, replay = sm.result, sm.replay
    timeline = np.asarray(res.timeline_allocated)
    # the last step's gradients and batch, freed at the loop head, are not the backward's
    at_phase = event_phases(replay, graph, len(timeline))
    named = [p for spans in windows.values() for p in spans]
    gap = res.peak_reserved - res.peak_allocated  # reserved above allocated at the peak

    def peak(mask: np.ndarray) -> WindowPeak:
        if not mask.any():
            return 0, None
        at = int(np.flatnonzero(mask)[np.argmax(timeline[mask])])
        allocated = int(timeline[at])
        return allocated, attribute_peak(graph, replay, at, allocated + gap, top_n)

    return {
        name: peak(np.isin(at_phase, spans) if spans else ~np.isin(at_phase, named))
        for name, spans in windows.items()
    }


def _copies(term: Term, inside_bytes: dict[str, int]) -> str:
    """How many workspaces a per-handle term's bytes hold, said beside its per-handle source
    (one for forward's handle on the Python thread, one for backward's on autograd's)."""
    count = inside_bytes.get(term.term, 0) // term.nbytes if term.nbytes else 0
    if term.placement != "per_handle" or count <= 1:
        return ""
    return f"; x {count} handles (forward on the Python thread, backward on autograd's)"
