"""Terminal rendering of a Prediction."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from boom_ml.estimates import Prediction

GIB = 1024**3


def render_table(prediction: Prediction) -> str:
    """One row per GPU, fastest first."""
    step = prediction.step
    title = (
        f"{prediction.model}  batch={prediction.batch_size}"
        + (f"  seq={step['seq_len']}" if step.get("seq_len") else "")
        + (f"  image={step['image_size']}" if step.get("image_size") else "")
        + f"  opt={step['optimizer']}  amp={step['amp']}  ckpt={step['checkpointing']}"
    )
    table = Table(title=title)
    for col in (
        "GPU",
        "fits",
        "peak GiB",
        "nvidia-smi GiB",
        "capacity GiB",
        "step ms",
        "samples/s",
        "method",
    ):
        table.add_column(col, justify="left" if col in ("GPU", "method") else "right")
    for g in sorted(prediction.gpus, key=lambda g: g.time.step_ms):
        m, t = g.memory, g.time
        table.add_row(
            g.gpu,
            "yes" if g.fits else "[red]no[/red]",
            f"{m.peak_allocated_bytes / GIB:.2f}",
            f"{m.total_bytes / GIB:.2f}",
            f"{m.capacity_bytes / GIB:.1f}",
            f"{t.step_ms:.1f}",
            f"{prediction.batch_size / t.step_ms * 1e3:.1f}",
            f"{m.method} / {t.method}",
        )
    graph = prediction.graph
    buf = io.StringIO()
    console = Console(file=buf, width=120, force_terminal=False)
    console.print(table)
    console.print(
        f"{graph['num_ops']} ops, {graph['flops'] / 1e12:.2f} TFLOP per step, "
        f"{graph['num_parameters'] / 1e6:.1f} M parameters, traced in {graph['trace_seconds']:.1f} s"
    )
    return buf.getvalue().rstrip()
