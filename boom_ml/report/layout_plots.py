"""PNG figure of a multi-GPU layout: its pipeline step as a timeline per rank, and the
memory of each pipeline stage's rank by category against the GPU's usable memory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers and laptops alike
import matplotlib.pyplot as plt  # noqa: E402

from boom_ml.parallel.schedule import simulate  # noqa: E402
from boom_ml.report.explain import GIB  # noqa: E402

FORWARD, BACKWARD, OPTIMIZER, EXPOSED = "#4477aa", "#ee7733", "#228833", "#aa3377"


def best_entry(parallel: list[dict[str, Any]]) -> dict[str, Any]:
    """The fastest GPU whose worst rank fits, else the fastest (as one GPU's plots pick)."""
    fitting = [e for e in parallel if e.get("fits")]
    return min(fitting or parallel, key=lambda e: e["time"]["step_ms"])


def plot_layout(entry: dict[str, Any], path: Path, title: str) -> Path:
    """Top: the simulated pipeline step (each rank's forwards and backwards of every
    micro-batch, then its optimizer step and the exposed data-parallel collectives).
    Bottom: each stage's rank memory by category (the worst rank's alone without a pipeline)."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(13, 7.5), height_ratios=[3, 2])
    _timeline(top, entry)
    _memory(bottom, entry)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _timeline(ax: Any, entry: dict[str, Any]) -> None:
    t, lay = entry["time"], entry["parallel"]
    pp, m = lay["pp"], lay["microbatches"]
    stages = t["virtual_stage_ms"]
    run = simulate(
        [s["forward_ms"] for s in stages],
        [s["backward_ms"] for s in stages],
        m,
        t.get("schedule", "1f1b"),
        pp=pp,
        p2p_ms=t.get("p2p_ms", 0.0),
    )
    label_width = run.total_ms / 60  # a box this wide has room for its micro-batch number
    for (kind, j, i), start in run.starts.items():
        width = run.ends[(kind, j, i)] - start
        rank, chunk = j % pp, j // pp
        colour = FORWARD if kind == "F" else BACKWARD
        ax.broken_barh([(start, width)], (rank - 0.4, 0.8), facecolors=colour,
                       edgecolor="white", linewidth=0.3, alpha=1.0 - 0.25 * (chunk % 2))  # fmt: skip
        if width > label_width:
            ax.text(start + width / 2, rank, str(i + 1), ha="center", va="center", fontsize=6,
                    color="white")  # fmt: skip
    for st in t["per_stage"]:  # after its last backward: exposed dp collectives, optimizer
        row, exposed = (st["stage"] - 0.4, 0.8), st["exposed_dp_ms"]
        ax.broken_barh([(st["end_ms"], exposed)], row, facecolors=EXPOSED)
        ax.broken_barh([(st["end_ms"] + exposed, st["optimizer_ms"])], row, facecolors=OPTIMIZER)
    done = t["finish_stage"]
    ax.set_yticks(range(pp), [f"rank {r}" + (" (ends the step)" if r == done and pp > 1 else "")
                              for r in range(pp)])  # fmt: skip
    ax.invert_yaxis()
    ax.set_xlabel("ms from the step's start")
    ax.set_title(
        f"step {t['step_ms']:.1f} ms: pipeline {t['pipeline_ms']:.1f} ({t.get('schedule', '1f1b')},"
        f" {m} micro-batches, numbered), bubble {t['bubble_ms']:.1f} ms"
        f" ({100 * t['bubble_fraction']:.1f} %)"
        + (
            "; lighter boxes: a rank's second, fourth ... model chunk"
            if lay["virtual_stages"] > 1
            else ""
        ),
        fontsize=9,
    )
    handles = [
        plt.Rectangle((0, 0), 1, 1, color=c) for c in (FORWARD, BACKWARD, OPTIMIZER, EXPOSED)
    ]
    ax.legend(handles, ["forward", "backward (+ gradient adds)", "optimizer step",
                        "exposed data-parallel communication"], loc="upper left",
              fontsize=7, ncols=4, bbox_to_anchor=(0, -0.16))  # fmt: skip


def _memory(ax: Any, entry: dict[str, Any]) -> None:
    mem = entry.get("memory")
    if not mem:
        ax.set_axis_off()
        return
    rows = mem.get("per_stage") or [mem]
    labels = [f"stage {i}" for i in range(len(rows))] if len(rows) > 1 else ["worst rank"]
    totals: dict[str, int] = {}
    for row in rows:
        for category, nbytes in row["breakdown"].items():
            totals[category] = totals.get(category, 0) + max(nbytes, 0)
    categories = [c for c, n in sorted(totals.items(), key=lambda kv: -kv[1]) if n]
    colours = plt.get_cmap("tab20").colors
    left = [0.0] * len(rows)
    for k, category in enumerate(categories):
        widths = [max(row["breakdown"].get(category, 0), 0) / GIB for row in rows]
        ax.barh(labels, widths, left=left, color=colours[k % len(colours)], label=category)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.axvline(mem["capacity_bytes"] / GIB, color="black", linestyle="--", linewidth=1)
    ax.text(mem["capacity_bytes"] / GIB, 1.0, "usable", ha="center", va="bottom", fontsize=7,
            transform=ax.get_xaxis_transform())  # fmt: skip
    ax.invert_yaxis()
    ax.set_xlabel("GiB per rank")
    ax.set_title(f"rank memory by category (worst {mem['total_bytes'] / GIB:.2f} GiB)", fontsize=9)
    # below the axis, as the timeline's: inside, it covered the last stage's bars
    ax.legend(fontsize=6, ncols=9, loc="upper left", bbox_to_anchor=(0, -0.22))
