"""Write every figure of a prediction into a directory (``plot=<dir>``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from boom_ml.estimates import Prediction
from boom_ml.gpus.spec import GpuSpec
from boom_ml.report.layout_plots import best_entry, plot_layout
from boom_ml.report.plot_dir import check_plot_dir
from boom_ml.report.plots import memory_timeline
from boom_ml.report.time_plots import plot_gpu_comparison, plot_time_breakdown
from boom_ml.trace.graph import OpGraph


def _safe(name: str) -> str:
    """A part of a file name: a model spec's or GPU id's path separators and colons as '_'
    (a GPU built in Python may be named 'My GPU/x': its figures had crashed the run)."""
    return name.replace(":", "_").replace("/", "_").replace("\\", "_")


def write_plots(
    prediction: Prediction, graph: OpGraph, gpus: list[GpuSpec], directory: str | Path,
    stack: Any = None, grad_accum: int = 1,
) -> list[Path]:  # fmt: skip
    """Memory timeline (replayed as the prediction was: ``stack``'s allocator options,
    ``grad_accum``) and time breakdown on the fastest GPU that fits (else the fastest),
    plus the GPU comparison when there is more than one GPU."""
    out = check_plot_dir(directory)
    best = prediction.best_gpu()
    spec = next(s for s in gpus if s.id == best.gpu)
    stem = _safe(prediction.model)
    written = [
        memory_timeline(
            graph,
            spec,
            out / f"{stem}_memory_{_safe(best.gpu)}.png",
            stack=stack,
            grad_accum=grad_accum,
        ),  # fmt: skip
        plot_time_breakdown(
            best,
            out / f"{stem}_time_{_safe(best.gpu)}.png",
            prediction.model,
            grad_accum=grad_accum,
        ),  # fmt: skip
    ]
    if len(prediction.gpus) > 1:
        written.append(plot_gpu_comparison(prediction, out / f"{stem}_gpus.png"))
    return written


def write_layout_plots(prediction: Prediction, directory: str | Path, title: str) -> list[Path]:
    """A layout's pipeline timeline and stage memory, on the fastest GPU whose worst rank
    fits (else the fastest)."""
    out = check_plot_dir(directory)
    entry = best_entry(prediction.parallel)
    stem = _safe(prediction.model)
    return [
        plot_layout(
            entry, out / f"{stem}_layout_{_safe(entry['gpu'])}.png", f"{title} on {entry['gpu']}"
        )
    ]
