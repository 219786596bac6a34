"""Report plots. ``memory_timeline``: allocated and reserved bytes over the replayed steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from boom_ml.gpus.spec import GpuSpec
from boom_ml.memory.replay import event_phases
from boom_ml.trace.graph import OpGraph

GIB = float(1 << 30)
# Band colours per phase; phases not listed (zero_grad, input) are left white.
PHASE_COLOURS = {
    "forward": "#cfe2f3",
    "loss": "#d9d2e9",
    "backward": "#fce5cd",
    "recompute": "#fff2cc",
    "optimizer": "#d9ead3",
}


def _phase_runs(phases: np.ndarray) -> list[tuple[str, int, int]]:
    """(phase, first index, last index + 1) of each run of equal phases."""
    if not len(phases):
        return []
    cuts = np.flatnonzero(phases[1:] != phases[:-1]) + 1
    starts = np.concatenate([[0], cuts])
    ends = np.concatenate([cuts, [len(phases)]])
    return [(str(phases[s]), int(s), int(e)) for s, e in zip(starts, ends, strict=True)]


def timeline_replay(
    graph: OpGraph, gpu: GpuSpec, stack: Any = None, grad_accum: int = 1, steps: int | None = None
) -> Any:
    """The replay a memory timeline draws: the prediction's (the stack's allocator options,
    gradients kept across micro-batches under accumulation, the GPU's limit, at which the
    allocator frees its cached blocks and retries); where the step does not fit, the replay
    without the limit, so the curve runs to the step's end above the usable line."""
    from boom_ml.memory.estimate import DEFAULT_STEPS, simulate_step

    def replay(capacity: bool) -> Any:
        return simulate_step(graph, gpu, stack=stack, steps=steps or DEFAULT_STEPS,
                             capacity=capacity, accumulate=grad_accum > 1)  # fmt: skip

    limited = replay(True)
    return replay(False) if limited.result.oom else limited


def memory_timeline(
    graph: OpGraph,
    gpu: GpuSpec,
    path: str | Path,
    steps: int | None = None,
    title: str | None = None,
    stack: Any = None,
    grad_accum: int = 1,
) -> Path:
    """Write a PNG of allocated and reserved memory over the replayed training steps.

    The replay is the prediction's: the stack's allocator options (``stack``) and, with
    ``grad_accum`` > 1, gradients kept between micro-batches. Shaded bands mark forward,
    loss, backward, recompute and optimizer phases; dashed lines mark the peak as nvidia-smi
    would show it (reserved plus the terms outside the allocator) and the memory the step
    may use (the GPU's, less what the driver and the runtime keep: ``capacity_bytes``), the
    latter only when the curves come within half of it (else the curves would be a line
    along the bottom: the legend then gives it).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sm = timeline_replay(graph, gpu, stack, grad_accum, steps)
    res, replay = sm.result, sm.replay
    phases = event_phases(replay, graph, len(res.timeline_allocated))
    step_of = replay.step[: len(phases)]
    x = np.arange(len(phases))

    fig, ax = plt.subplots(figsize=(13, 4.5), dpi=110)
    labelled: set[str] = set()
    for phase, a, b in _phase_runs(np.char.add(phases, step_of.astype(str))):
        name = phase.rstrip("0123456789")
        colour = PHASE_COLOURS.get(name)
        if colour is None:
            continue
        label = name if name not in labelled else None
        labelled.add(name)
        ax.axvspan(a, b, color=colour, lw=0, label=label)
    for k in np.unique(step_of)[1:]:
        ax.axvline(int(np.argmax(step_of == k)), color="grey", lw=0.6, ls=":")
    ax.plot(x, res.timeline_reserved / GIB, color="#c0392b", lw=1.2, label="reserved")
    ax.plot(x, res.timeline_allocated / GIB, color="#1f4e79", lw=1.0, label="allocated")
    outside = sum(sm.outside_bytes.values())
    ax.axhline((res.peak_reserved + outside) / GIB, color="#c0392b", lw=0.8, ls="--",
               label=f"peak as nvidia-smi ({outside / GIB:.2f} GiB outside the allocator)")  # fmt: skip
    peak, usable = res.peak_reserved + outside, gpu.capacity_bytes
    label = f"{gpu.id} usable memory ({usable / GIB:.1f} GiB)"
    if peak >= usable / 2:
        ax.axhline(usable / GIB, color="black", lw=0.8, ls="--", label=label)
    else:  # far below: the axis follows the curves, the legend names the limit
        ax.plot([], [], color="black", lw=0.8, ls="--", label=label + ", above the axis")
    ax.set_xlim(0, max(len(x) - 1, 1))
    ax.set_ylim(0, max(usable if peak >= usable / 2 else 0, peak) / GIB * 1.08)
    replayed = int(step_of.max()) if len(step_of) else 0
    ax.set_xlabel(
        f"allocator event ({replayed} training steps)"
        if grad_accum <= 1
        # the replay runs the optimizer's phase after every micro-batch (memory/replay.py)
        else f"allocator event ({replayed} micro-batches, each replayed with the optimizer's "
        f"phase; grad_accum={grad_accum} runs it once every {grad_accum})"
    )
    ax.set_ylabel("GiB")
    model = graph.meta.get("model", "")
    batch = graph.meta.get("step", {}).get("batch_size", "")
    ax.set_title(title or f"{model} batch {batch} on {gpu.id}: memory over the step")
    # beside the axes: inside, it covered the first step's curves (they rise from the left)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, borderaxespad=0)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
