"""Step measurements joined to traced operator graphs: the GNN's dataset.

Every usable row of the canonical steps table is traced as the configuration it measured
(``training/step_traces.py``: configuration, trace, on-disk cache). Each row then gets the
GPU-dependent inputs (per-op times on that GPU, spec features) from
``boom_ml.timing.gnn_features``, the same functions inference uses, and the measured step
time as target.

What is left out, and why, is counted in ``StepGraphDataset.excluded``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch

from boom_ml.gpus import get_gpu
from boom_ml.timing.gnn_features import (
    FEATURE_VERSION,
    RowInputs,
    graph_data,
    per_op_function,
    pyg_types,
    row_inputs,
)
from boom_ml.timing.tf32 import Tf32
from boom_ml.trace.graph import OpGraph
from data_collection.paths import repo_root
from training.step_traces import GraphCache, TraceConfig, row_tf32, row_trace_config

if TYPE_CHECKING:
    from torch_geometric.data import Data

DEFAULT_SOURCES = ("cnn_step_times", "timm_train", "neusight_labels")
# Sources we never train on, with the reason printed next to their count.
SOURCE_REASONS = {"timm_infer": "timm_infer: forward-only inference benchmark, not a training step"}
MULTI_VARIANTS = ("dataparallel", "dp4", "tp4", "pp4_1")
COMPILED_VARIANTS = ("fusion", "dynamo")


def select_rows(steps: pd.DataFrame, cfg: dict[str, Any]) -> tuple[pd.DataFrame, dict[str, int]]:
    """Rows we can trace faithfully, their TraceConfig, and counts of what was dropped."""
    excluded: dict[str, int] = {}
    df = steps.copy()

    def drop(mask: pd.Series, reason: str) -> None:
        nonlocal df
        mask = mask.fillna(False).astype(bool)
        if mask.any():
            excluded[reason] = excluded.get(reason, 0) + int(mask.sum())
        df = df[~mask]

    sources = tuple(cfg.get("sources", DEFAULT_SOURCES))
    for src in sorted(set(df["source"]) - set(sources)):
        drop(df["source"] == src, SOURCE_REASONS.get(src, f"{src}: source not selected"))
    drop(df["device_kind"].astype(str) != "gpu", "not a GPU measurement")
    drop(df["oom"].fillna(False) | df["step_time_ms"].isna(), "OOM or no step time")
    drop((df["num_gpus"] > 1) | df["variant"].isin(MULTI_VARIANTS), "multi-GPU (num_gpus > 1)")
    drop(df["variant"].isin(COMPILED_VARIANTS), "torch.compile (fusion/dynamo)")
    drop(df["precision"] == "float64", "float64: GpuSpec has no FP64 peak")
    drop(df["precision"] == "bfloat16", "pure bf16 model: not traced")
    if not cfg.get("forward_only_rows", True):
        drop(df["phase_scope"] == "fwd", "forward-only rows (disabled)")
    drop(~df["gpu_id"].map(_known_gpu), "GPU not in the spec table")
    if cfg.get("models"):  # a named subset (tests, quick experiments)
        drop(~df["model"].isin(list(cfg["models"])), "model not in data.models")
    df, skipped = _timm_subset(df, int(cfg.get("timm_models", 150)), int(cfg.get("seed", 0)))
    excluded.update(skipped)
    return df.reset_index(drop=True), excluded


def _known_gpu(gpu_id: str) -> bool:
    try:
        get_gpu(gpu_id)
        return True
    except Exception:  # noqa: BLE001
        return False


def _timm_subset(df: pd.DataFrame, n_models: int, seed: int) -> tuple[pd.DataFrame, dict]:
    """A stratified, seeded subset of timm_train models (tracing all 838 is too slow here).

    Strata are quintiles of measured ms per sample (a cost proxy that spans tiny to huge
    models); within a stratum the cheaper models are preferred by sampling with weights
    1/sqrt(rank), since big models take longest to trace. Both layouts of a chosen model stay.
    """
    import timm

    timm_rows = df["source"] == "timm_train"
    if not timm_rows.any():
        return df, {}
    t = df[timm_rows]
    names = t["model"].str.removeprefix("timm:")
    gone = ~names.map(timm.is_model)
    cost = (t["step_time_ms"] / t["batch_size"]).groupby(t["model"][~gone]).median()
    strata = pd.qcut(cost.rank(method="first"), 5, labels=False)
    rng = np.random.default_rng(seed)
    chosen: list[str] = []
    for s in range(5):
        members = cost[strata == s].sort_values().index.to_numpy()
        k = min(len(members), n_models // 5 + (s < n_models % 5))
        w = 1.0 / np.arange(1, len(members) + 1) ** 0.5
        chosen += list(rng.choice(members, size=k, replace=False, p=w / w.sum()))
    keep = ~timm_rows | t["model"].isin(chosen).reindex(df.index, fill_value=True)
    skipped = {
        f"timm_train: model missing from installed timm {timm.__version__}": int(gone.sum()),
        f"timm_train: not in the {len(chosen)}-model subset (seed {seed})": int(
            (timm_rows & ~keep).sum() - gone.sum()
        ),
    }
    return df[keep], {k: v for k, v in skipped.items() if v}


@dataclass
class StepGraphDataset:
    """Unique graphs (PyG ``Data``) and one row per measurement pointing at its graph."""

    rows: pd.DataFrame  # source, gpu_id, model, family, graph, target_ms, baseline_ms, ...
    graphs: list[Data]
    inputs: list[RowInputs]
    per_op: (
        str  # name of the per-op time function (see boom_ml.timing.gnn_features.per_op_function)
    )
    excluded: dict[str, int] = field(default_factory=dict)
    trace_seconds: float = 0.0
    traced: list[OpGraph] = field(default_factory=list)  # the OpGraphs behind ``graphs``

    def with_per_op(self, name: str, per_op_fn: Any) -> StepGraphDataset:
        """The same rows and graphs with inputs and baseline from another per-op function
        (a CV fold's heads); the graph features are shared, not rebuilt."""
        inputs, base = featurise(self.rows, self.traced, per_op_fn)
        rows = self.rows.assign(baseline_ms=base)
        return StepGraphDataset(rows, self.graphs, inputs, name, self.excluded,
                                self.trace_seconds, self.traced)  # fmt: skip

    def __len__(self) -> int:
        return len(self.rows)

    def as_data(self, i: int) -> Data:
        """Row ``i`` as one self-contained PyG graph (for inspection; training shares graphs)."""
        g, r = self.graphs[int(self.rows["graph"].iat[i])], self.inputs[i]
        Data = pyg_types()[1]  # noqa: N806 (PyG's class; imported only when used)
        return Data(x=torch.cat([g.x, r.dynamic], 1), edge_index=g.edge_index,
                    edge_type=g.edge_type, u=r.context[None], y=torch.tensor([self.rows["target_ms"].iat[i]]))  # fmt: skip


def build_dataset(
    steps: pd.DataFrame, cfg: dict[str, Any], per_op: str | None = None, verbose: bool = True
) -> StepGraphDataset:
    """Select, trace (cached), and featurise the step rows."""
    rows, excluded = select_rows(steps, cfg)
    cache = GraphCache(Path(cfg.get("cache_dir") or repo_root() / "data" / "graph_cache"))
    per_op_name, per_op_fn = per_op_function(per_op)
    rows["config"] = [row_trace_config(r) for _, r in rows.iterrows()]
    configs = list(dict.fromkeys(rows["config"]))
    graphs: dict[TraceConfig, OpGraph] = {}
    failures: dict[str, int] = {}
    for i, c in enumerate(configs):
        got = cache.get(c)
        if isinstance(got, str):
            why = f"trace failed: {c.model}: {got.split(': ', 1)[-1][:90]}"
            failures[why] = failures.get(why, 0) + int((rows["config"] == c).sum())
        else:
            graphs[c] = got
        if verbose and cache.traced and cache.traced % 20 == 0 and i < len(configs) - 1:
            print(f"  traced {cache.traced} configs ({cache.seconds:.0f} s) ...", flush=True)
    excluded.update(failures)
    rows = rows[rows["config"].isin(set(graphs))].reset_index(drop=True)
    order = {c: k for k, c in enumerate(graphs)}
    data = [graph_data(g) for g in graphs.values()]
    ordered = list(graphs.values())
    rows["graph"] = rows["config"].map(order)
    rows["family"] = [str(ordered[g].meta.get("model_family", "other")) for g in rows["graph"]]
    rows["tf32_matmul"] = [row_tf32(r).matmul for _, r in rows.iterrows()]
    rows["tf32_cudnn"] = [row_tf32(r).cudnn for _, r in rows.iterrows()]
    rows["target_ms"] = rows["step_time_ms"].astype(float)
    # run_id and source_path name the measuring run (training/run_bias.py reads them).
    keep = ["source", "gpu_id", "model", "family", "batch_size", "seq_len", "image_size",
            "precision", "amp", "phase_scope", "channels_last", "tf32_matmul", "tf32_cudnn",
            "graph", "target_ms", "run_id", "source_path"]  # fmt: skip
    inputs, base = featurise(rows[keep], ordered, per_op_fn)
    ds = StepGraphDataset(rows[keep].assign(baseline_ms=base), data, inputs, per_op_name,
                          excluded, cache.seconds, traced=ordered)  # fmt: skip
    if verbose:
        print(describe(ds, len(configs), cache.traced))
        if cache.stale:
            print(f"note: {cache.stale} cached graphs come from other tracer/zoo code than "
                  f"the current (delete {cache.dir} to retrace them)")  # fmt: skip
    return ds


def featurise(
    rows: pd.DataFrame, graphs: list[OpGraph], per_op_fn: Any
) -> tuple[list[RowInputs], np.ndarray]:
    """Each row's GPU-dependent model inputs and its sum-of-per-op baseline (ms), from the
    per-op time function ``per_op_fn`` (the packaged heads, a CV fold's heads, the roofline).
    Rows of one graph and TF32 setting get their per-op times in one call where the function
    can (``many``: a graph's kernel rows featurised once for all its GPUs)."""
    inputs: list[RowInputs | None] = [None] * len(rows)
    base = np.zeros(len(rows))
    keys = ["graph", "tf32_matmul", "tf32_cudnn", "channels_last"]
    rows = rows.reset_index(drop=True)
    rows = rows.assign(channels_last=rows["channels_last"].fillna(False).astype(bool))
    for (g, matmul, cudnn, cl), group in rows.groupby(keys, sort=False):
        graph, tf32 = graphs[int(g)], Tf32(bool(matmul), bool(cudnn))
        gpus = [get_gpu(str(x)) for x in group["gpu_id"]]
        if hasattr(per_op_fn, "many"):  # the layout changes convolutions' transforms only
            all_ms = per_op_fn.many(graph.nodes, gpus, tf32, bool(cl))
        else:
            all_ms = [per_op_fn(graph.nodes, gpu, tf32) for gpu in gpus]
        for i, gpu, ms in zip(group.index, gpus, all_ms, strict=True):
            ms = np.asarray(ms, dtype=float)
            inputs[i] = row_inputs(graph, gpu, tf32, ms, bool(cl))
            base[i] = float(ms.sum())
    return inputs, base  # type: ignore[return-value]


def describe(ds: StepGraphDataset, n_configs: int, n_traced: int) -> str:
    lines = [f"step rows used: {len(ds)} over {len(ds.graphs)} traced graphs "
             f"({n_configs} configs, {n_traced} traced now in {ds.trace_seconds:.0f} s; "
             f"per-op times: {ds.per_op}; features v{FEATURE_VERSION})"]  # fmt: skip
    counts = ds.rows.groupby(["source", "family"]).size()
    lines += [f"  {s} / {f}: {n} rows" for (s, f), n in counts.items()]
    lines.append("excluded rows:")
    lines += [f"  {n:6d}  {reason}" for reason, n in ds.excluded.items()]
    return "\n".join(lines)
