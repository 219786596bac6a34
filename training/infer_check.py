"""The per-op sum on GPUs no kernel row was measured on: timm's forward-pass benchmarks.

    python -m training.infer_check [--models N] [--seed S]

timm's inference benchmarks (``timm_bench/infer/``, read its SOURCE.md) time a forward pass
under fp16 autocast on an RTX 3090, RTX 4090, RTX 5090 and RTX PRO 6000 Blackwell Max-Q. No
kernel table (NeuSight, DeepBench, Vidur) measured any of them, so every per-op head
extrapolates there along its GPU features: this is how the per-op sum transfers to consumer
Ampere, Ada and Blackwell cards. None of these rows trains anything (``graph_dataset`` leaves
``timm_infer`` out), and nothing is fitted to what this prints.

What is compared: the measured ``infer_step_time`` against the sum of the packaged per-op
predictions over the forward nodes of the same model, batch and image size
(``step_traces.TraceConfig.forward_only``: the forward of a traced training step, the layout
the row ran in). A training-mode forward differs from ``model.eval()`` in its batch
normalisation statistics and dropout; the norm head times both batch norms from the same
shape, and the models' dropout is in their classifier heads. Rows compiled with
``torch.compile`` (``dynamo``) and Hopper rows (``held_out.py``) are left out; so are timm
models the installed timm no longer has. ``--models`` takes a seeded subset of the models
(every row of each), as tracing all 1,600 takes hours here; traces are cached in
``data/graph_cache/``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from training.held_out import held_out_mask

SOURCE = "timm_infer"
USAGE = "python -m training.infer_check [--models N] [--seed S]"
DEFAULT_MODELS, DEFAULT_SEED = 40, 0
MATMUL_FAMILIES = ("gemm", "attention")
OFF_BY = 15.0  # the share of rows within this many percent of the measurement is printed


def select_rows(steps: pd.DataFrame, kernel_gpus: set[str]) -> pd.DataFrame:
    """Eager-mode ``timm_infer`` rows of GPUs with no kernel rows, Hopper left out."""
    rows = steps[steps["source"] == SOURCE]
    rows = rows[(rows["variant"].fillna("") == "") & ~rows["gpu_id"].isin(kernel_gpus)]
    return rows[~held_out_mask(rows)].reset_index(drop=True)


def pick_models(rows: pd.DataFrame, n_models: int, seed: int, available: set[str]) -> list[str]:
    """A seeded sample of ``n_models`` of the rows' models that ``available`` (the installed
    timm's names) still has, in sorted order."""
    names = sorted(m for m in rows["model"].unique() if m.removeprefix("timm:") in available)
    rng = np.random.default_rng(seed)
    picked = rng.choice(len(names), size=min(n_models, len(names)), replace=False)
    return sorted(names[i] for i in picked)


def conv_kind(nodes: pd.DataFrame) -> str:
    """``depthwise`` if a forward 2-D convolution has one input channel per group, ``conv`` if
    convolutions do at least half the forward's FLOPs, else ``other`` (transformers and MLPs,
    whose one convolution embeds the patches)."""
    forward = nodes[nodes["phase"] == "forward"]
    convs = forward[forward["family"] == "conv"]
    for shapes in convs["input_shapes"]:
        x, w = (json.loads(shapes) + [[], []])[:2]
        if len(x) == 4 and len(w) == 4 and w[1] == 1 and x[1] > 1:
            return "depthwise"
    return "conv" if 2 * convs["flops"].sum() >= forward["flops"].sum() > 0 else "other"


def predict_rows(rows: pd.DataFrame, log=print, cache_dir: Path | None = None) -> pd.DataFrame:
    """``rows`` with ``pred_ms`` (the per-op sum of the forward), ``kind`` (conv_kind), and
    the forward's matrix-multiply FLOPs (GEMM and attention nodes) with their share of
    ``pred_ms`` (``gemm_flops``, ``gemm_pred_ms``). Rows whose model fails to trace are
    dropped, and counted. Traces are kept in ``cache_dir`` (default ``data/graph_cache``)."""
    from boom_ml.gpus import get_gpu
    from boom_ml.timing.dominance import dominated_extra
    from boom_ml.timing.per_op import node_ms_many
    from data_collection.paths import repo_root
    from training.step_traces import GraphCache, row_tf32, row_trace_config

    cache = GraphCache(cache_dir or repo_root() / "data" / "graph_cache")
    found: list[dict] = []
    for i, row in enumerate(rows.itertuples(index=False)):
        if i % 50 == 0:
            log(f"  {i}/{len(rows)} rows ({cache.traced} traced, {cache.seconds:.0f} s)")
        series = pd.Series(row._asdict())
        graph = cache.get(row_trace_config(series))
        if isinstance(graph, str):
            found.append({"pred_ms": np.nan})
            continue
        gpu = get_gpu(str(row.gpu_id))
        # the packaged GPUs it beats on every spec number too: the table's step dominance
        every = node_ms_many(graph.nodes, [gpu, *dominated_extra([gpu])], tf32=row_tf32(series),
                             channels_last=bool(row.channels_last))  # fmt: skip
        ms = every[0]
        matmul = graph.nodes["family"].isin(MATMUL_FAMILIES).to_numpy()
        found.append({"pred_ms": float(ms.sum()), "kind": conv_kind(graph.nodes),
                      "dominated_ms": min(float(m.sum()) for m in every),
                      "gemm_flops": float(graph.nodes["flops"][matmul].sum()),
                      "gemm_pred_ms": float(ms[matmul].sum())})  # fmt: skip
    out = pd.concat([rows, pd.DataFrame(found, index=rows.index)], axis=1)
    failed = int(out["pred_ms"].isna().sum())
    if failed:
        log(f"  {failed} rows left out: their model failed to trace (the cache keeps why)")
    return out[out["pred_ms"].notna()].reset_index(drop=True)


def gemm_rates(scored: pd.DataFrame) -> pd.DataFrame:
    """Per GPU, the row whose matrix multiplies run fastest by the measurement: its GEMM FLOPs
    over the whole measured step, a lower bound of the rate they ran at (the step also does
    everything else), beside the rate the per-op sum gives them and the spec sheet's fp16."""
    from boom_ml.gpus import get_gpu

    rows = scored[scored["gemm_flops"] > 0].assign(
        measured=lambda d: d["gemm_flops"] / d["step_time_ms"] / 1e9,
        predicted=lambda d: d["gemm_flops"] / d["gemm_pred_ms"] / 1e9,
    )
    best = rows.loc[rows.groupby("gpu_id")["measured"].idxmax()]
    spec = best["gpu_id"].map(lambda g: get_gpu(g).peak_flops("float16") / 1e12)
    return pd.DataFrame({
        "gpu_id": best["gpu_id"], "model": best["model"], "batch": best["batch_size"],
        "GEMM TFLOP": (best["gemm_flops"] / 1e12).round(1), "measured ms": best["step_time_ms"],
        "measured TFLOPS >=": best["measured"].round(1),
        "per-op TFLOPS": best["predicted"].round(1), "fp16 spec TFLOPS": spec.round(1),
    }).set_index("gpu_id")  # fmt: skip


def layout_ratio(rows: pd.DataFrame) -> pd.DataFrame:
    """Measured NCHW / channels_last step time of the same model, batch and image size, per
    GPU and stack (every selected row that has both layouts, not only the sampled models)."""
    keys = ["gpu_id", "torch_version", "model", "batch_size", "image_size"]
    layout = rows["channels_last"].astype(bool)
    nchw = rows[~layout].groupby(keys)["step_time_ms"].median()
    nhwc = rows[layout].groupby(keys)["step_time_ms"].median()
    ratio = (nchw / nhwc).dropna()
    return (
        ratio.groupby(level=["gpu_id", "torch_version"])
        .agg(["size", "median", "mean"])
        .rename(columns={"size": "pairs"})
        .round(3)
    )


def summary(scored: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """Per group: rows, MAPE %, the median of predicted / measured, and the share within
    ``OFF_BY`` percent."""
    err = 100 * (scored["pred_ms"] - scored["step_time_ms"]).abs() / scored["step_time_ms"]
    ratio = scored["pred_ms"] / scored["step_time_ms"]
    frame = scored[by].assign(err=err, ratio=ratio)
    return frame.groupby(by, sort=True).agg(
        rows=("err", "size"),
        mape=("err", "mean"),
        median_ratio=("ratio", "median"),
        within=("err", lambda e: 100 * float((e <= OFF_BY).mean())),
    ).rename(columns={"mape": "MAPE %", "median_ratio": "median pred/meas",
                      "within": f"within {OFF_BY:.0f} % (%)"}).round(2)  # fmt: skip


def _options(args: list[str]) -> tuple[int, int] | str:
    values = {"--models": DEFAULT_MODELS, "--seed": DEFAULT_SEED}
    while args:
        flag, eq, raw = args.pop(0).partition("=")  # --models 3 or --models=3
        if flag not in values or not (eq or args):
            return f"unknown or incomplete option {flag!r}"
        raw = raw if eq else args.pop(0)
        if not raw.isdigit() or (flag == "--models" and int(raw) == 0):
            kind = "positive" if flag == "--models" else "non-negative"
            return f"{flag} takes a {kind} whole number, not {raw!r}"
        values[flag] = int(raw)
    return values["--models"], values["--seed"]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    options = _options(args)
    if isinstance(options, str):
        print(f"error: {options}; {USAGE}", file=sys.stderr)
        return 2
    import timm

    from data_collection.schema import load_kernels, load_steps

    n_models, seed = options
    rows = select_rows(load_steps(sources=[SOURCE]), set(load_kernels()["gpu_id"].astype(str)))
    if rows.empty:
        print("no timm_infer rows: run `python -m data_collection.import_public` first")
        return 1
    models = pick_models(rows, n_models, seed, set(timm.list_models()))
    rows_all, rows = rows, rows[rows["model"].isin(models)].reset_index(drop=True)
    print(f"{len(rows)} rows of {len(models)} models (seed {seed}) on "
          f"{', '.join(sorted(rows['gpu_id'].unique()))}", flush=True)  # fmt: skip
    scored = predict_rows(rows, log=lambda s: print(s, flush=True))
    layout = np.where(scored["channels_last"].astype(bool), "nhwc", "nchw")
    scored = scored.assign(layout=layout)
    print("\nPer-op sum of the forward vs timm's measured inference step, per GPU and stack:")
    print(summary(scored, ["gpu_id", "torch_version", "layout"]).to_string())
    print("\nPer GPU and kind of model (depthwise: any depthwise convolution):")
    print(summary(scored, ["gpu_id", "kind"]).to_string())
    print("\nThe fastest matrix multiplies measured per GPU (GEMM FLOPs / whole step):")
    print(gemm_rates(scored).to_string())
    print("\nMeasured NCHW / channels_last step time, same model, batch and size:")
    print(layout_ratio(rows_all).to_string())
    print("\nAll rows:")
    print(summary(scored.assign(all="all"), ["all"]).to_string())
    # step dominance (boom_ml/timing/dominance.py), decided before this check: each row no
    # slower than the per-op sum on a packaged GPU its GPU beats on every spec number
    dominated = scored.assign(pred_ms=scored["dominated_ms"], all="all")
    print("\nWith step dominance (per GPU, then all rows):")
    print(summary(dominated, ["gpu_id"]).to_string())
    print(summary(dominated, ["all"]).to_string())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
