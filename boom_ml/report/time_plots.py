"""PNG plots of predicted time: by op family, by module, and across GPUs (time and cost)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers and laptops alike
import matplotlib.pyplot as plt  # noqa: E402

from boom_ml.estimates import GpuPrediction, Prediction, TimeEstimate, usd_text  # noqa: E402


def _barh(ax, labels: list[str], values: list[float], xlabel: str) -> None:
    ax.barh(labels[::-1], values[::-1], color="#4477aa")
    ax.set_xlabel(xlabel)
    for y, v in enumerate(values[::-1]):
        ax.text(v, y, f" {v:.1f}", va="center", fontsize=8)
    ax.margins(x=0.15)


def plot_time_breakdown(result: GpuPrediction, path: Path, title: str, grad_accum: int = 1) -> Path:
    """Two panels: predicted ms by op family and by module (top 10) on one GPU. Under
    accumulation the bars are one micro-batch's (and the optimizer step's, run once), as
    ``time.by_family`` and the module lists hold them; the title keeps the whole step."""
    t = result.time
    unit = (
        "ms per step" if grad_accum == 1 else f"ms per micro-batch (x{grad_accum}; optimizer once)"
    )
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    families = family_bars(t, grad_accum)
    _barh(left, [k for k, _ in families], [v for _, v in families], unit)
    left.set_title("by op family")
    modules = (t.top_module_groups or t.top_modules)[:10]
    labels = [
        _short(m["module"]) + (f" x{m['blocks']}" if m.get("blocks", 1) > 1 else "")
        for m in modules
    ]
    _barh(right, labels, [m["ms"] for m in modules], unit)
    right.set_title("by module (top 10, repeated blocks summed)")
    fig.suptitle(f"{title} on {result.gpu}: {t.step_ms:.1f} ms ({t.method})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def family_bars(t: TimeEstimate, grad_accum: int = 1) -> list[tuple[str, float]]:
    """The by-family panel's bars: the top 10 families, then the GNN's per-step overhead (in
    ``step_ms``, in no op family or module; one micro-batch's share under accumulation)."""
    bars = sorted(t.by_family.items(), key=lambda kv: -kv[1])[:10]
    if t.overhead_ms:
        bars.append(("GNN overhead (no op)", t.overhead_ms / grad_accum))
    return bars


def plot_gpu_comparison(prediction: Prediction, path: Path) -> Path:
    """Step time per GPU with its p10–p90 interval, and cost per 1,000 steps where priced."""
    gpus = sorted(prediction.gpus, key=lambda g: g.time.step_ms)
    names = [g.gpu for g in gpus]
    ms = [g.time.step_ms for g in gpus]
    low = [g.time.step_ms - (g.time.p10_ms or g.time.step_ms) for g in gpus]
    high = [(g.time.p90_ms or g.time.step_ms) - g.time.step_ms for g in gpus]
    colors = ["#4477aa" if g.fits else "#cccccc" for g in gpus]
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(12, max(3.0, 0.3 * len(gpus) + 1.5)), sharey=True
    )
    left.barh(names[::-1], ms[::-1], xerr=[low[::-1], high[::-1]], color=colors[::-1])
    left.set_xlabel("predicted step time, ms (grey: does not fit)")
    cost = [g.usd_per_1000_steps for g in gpus]
    right.barh(names[::-1], [c or 0 for c in cost[::-1]], color=colors[::-1])
    for y, c in enumerate(cost[::-1]):
        right.text(c or 0, y, f" ${usd_text(c)}" if c else " no price", va="center", fontsize=8)
    right.set_xlabel("USD per 1,000 steps (on-demand price)")
    right.margins(x=0.2)
    if not any(cost):  # no GPU priced (user YAML specs): an axis from 0, not around it
        right.set_xlim(0, 1)
        right.set_xticks([])
    fig.suptitle(f"{prediction.model}, batch {prediction.batch_size}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _short(module: str, width: int = 40) -> str:
    """The module path less its root (every path starts with the model's class), then its
    last ``width`` characters."""
    if "." in module and not module.startswith("("):
        module = module.split(".", 1)[1]
    return module if len(module) <= width else "…" + module[-(width - 1) :]
