"""Write every figure of a prediction into a directory (``plot=<dir>``)."""

from __future__ import annotations

import os
from pathlib import Path

from boom_ml.errors import InvalidInputError
from boom_ml.estimates import Prediction
from boom_ml.gpus.spec import GpuSpec
from boom_ml.report.plots import memory_timeline
from boom_ml.report.time_plots import plot_gpu_comparison, plot_time_breakdown
from boom_ml.trace.graph import OpGraph


def check_plot_dir(directory: str | Path) -> Path:
    """Create ``directory`` or fail with one clear line if it cannot be written."""
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise InvalidInputError(
            f"cannot create plot directory {str(path)!r}: {err.strerror}"
        ) from err
    if not os.access(path, os.W_OK):
        raise InvalidInputError(f"plot directory {str(path)!r} is not writable")
    return path


def write_plots(
    prediction: Prediction, graph: OpGraph, gpus: list[GpuSpec], directory: str | Path
) -> list[Path]:
    """Memory timeline and time breakdown on the fastest GPU that fits (else the fastest),
    plus the GPU comparison when there is more than one GPU."""
    out = check_plot_dir(directory)
    ranked = sorted(prediction.gpus, key=lambda g: (not g.fits, g.time.step_ms))
    best = ranked[0]
    spec = next(s for s in gpus if s.id == best.gpu)
    stem = prediction.model.replace(":", "_").replace("/", "_")
    written = [
        memory_timeline(graph, spec, out / f"{stem}_memory_{best.gpu}.png", title=prediction.model),
        plot_time_breakdown(best, out / f"{stem}_time_{best.gpu}.png", prediction.model),
    ]
    if len(prediction.gpus) > 1:
        written.append(plot_gpu_comparison(prediction, out / f"{stem}_gpus.png"))
    return written
