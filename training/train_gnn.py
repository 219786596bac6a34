"""Train the GNN step-time model, cross-validate it against the sum of per-op times.

    python -m training.train_gnn                      # CV table, package, MLflow
    python -m training.train_gnn train.epochs=5 cv.gpus=false   # Hydra overrides

Cross-validation holds out one GPU at a time (does it transfer to an unseen GPU?) and one
model family at a time (CNN / transformer: to an unseen kind of model?). The baseline, the
sum of the same per-op times the GNN starts from, is scored on the same held-out rows. In a
GPU fold, every row's per-op times (the GNN's inputs and the baseline) come from per-op heads
retrained without that GPU's kernel rows (``training/fold_heads.py``); family folds hold out
the family's step rows and use heads trained on every kernel GPU.
The final model is fit on every row and packaged to ``boom_ml/artifacts/gnn`` with a
manifest that says, per model family, whether the predictor should use it.
"""

from __future__ import annotations

import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import pandas as pd
import torch
from omegaconf import DictConfig, OmegaConf

from boom_ml import config_help
from boom_ml.config_help import one_line_errors, print_help_if_asked
from boom_ml.timing.gnn_artifact import ARTIFACT_DIR, regime, save_model
from boom_ml.timing.gnn_features import FEATURE_VERSION, RowBatch, collate, heads_function
from boom_ml.timing.gnn_model import GnnEnsemble, StepGNN, spec_range_of
from training import intervals, run_bias
from training.gnn_decision import cv_table, decide, mape, markdown
from training.graph_dataset import StepGraphDataset, build_dataset

CONFIG_DIR = str(config_help.CONFIG_DIR)
FAMILY_FOLDS = ("cnn", "transformer")


def make_batch(ds: StepGraphDataset, idx: np.ndarray) -> RowBatch:
    gids = ds.rows["graph"].to_numpy()[idx]
    uniq = list(dict.fromkeys(gids.tolist()))
    local = {g: k for k, g in enumerate(uniq)}
    return collate(
        [ds.graphs[g] for g in uniq], [local[g] for g in gids], [ds.inputs[i] for i in idx]
    )


def graph_batches(
    ds: StepGraphDataset, idx: np.ndarray, size: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Shuffled batches of about ``size`` rows made of whole graphs' rows.

    A graph's rows (one per GPU that measured it) share its message passing, which is
    the expensive part; batching them together runs it once per graph per epoch.
    """
    gids = ds.rows["graph"].to_numpy()[idx]
    groups = [idx[gids == g] for g in rng.permutation(np.unique(gids))]
    out, cur = [], []
    for grp in groups:
        cur.append(grp)
        if sum(len(c) for c in cur) >= size:
            out.append(np.concatenate(cur))
            cur = []
    return [*out, np.concatenate(cur)] if cur else out


def row_weights(rows: pd.DataFrame) -> np.ndarray:
    """Sources weigh by sqrt of their share: the 60 NeuSight rows are not drowned by CNNs."""
    n = rows.groupby("source")["source"].transform("size").to_numpy(dtype=float)
    w = np.sqrt(len(rows) / n)
    return w / w.mean()


def train_model(ds: StepGraphDataset, idx: np.ndarray, cfg: DictConfig) -> StepGNN | GnnEnsemble:
    """Fit a fresh model on rows ``idx``: ``train.members`` GNNs from seeds ``train.seed``,
    ``train.seed + 1``, ... averaged (one member: that GNN alone)."""
    members = int(cfg.train.get("members", 1))
    seed = int(cfg.train.seed)
    models = [_train_one(ds, idx, cfg, seed + k) for k in range(members)]
    return models[0] if members == 1 else GnnEnsemble(models)


def _train_one(ds: StepGraphDataset, idx: np.ndarray, cfg: DictConfig, seed: int) -> StepGNN:
    """One GNN fit on rows ``idx`` from ``seed``: weighted MSE of log step time."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    options = OmegaConf.to_container(cfg.model)
    clamp = options.pop("spec_clamp", False)
    spec_range = spec_range_of(torch.stack([ds.inputs[i].context for i in idx])) if clamp else None
    model = StepGNN(**options, spec_range=spec_range)
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay
    )
    # Batches are collated once per fit (collation costs about as much as a step); each
    # epoch visits them in a new order.
    chunks = graph_batches(ds, idx, int(cfg.train.batch_rows), rng)
    batches = [make_batch(ds, c) for c in chunks]
    weights = row_weights(ds.rows)  # by source share over all rows: the same in every fold
    log_y = np.log(ds.rows["target_ms"].to_numpy())
    targets = [(torch.tensor(log_y[c], dtype=torch.float32), torch.tensor(weights[c], dtype=torch.float32))
               for c in chunks]  # fmt: skip
    total = int(cfg.train.epochs) * len(batches)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.train.lr, total_steps=max(total, 1))
    model.train()
    for _ in range(int(cfg.train.epochs)):
        for k in rng.permutation(len(batches)):
            _, _, step = model(batches[k])
            y, w = targets[k]
            loss = (w * (torch.log(step) - y) ** 2).sum() / w.sum()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    model.eval()
    return model


def predict_rows(
    model: StepGNN | GnnEnsemble, ds: StepGraphDataset, idx: np.ndarray, size: int = 64
) -> np.ndarray:
    out = []
    with torch.no_grad():
        for start in range(0, len(idx), size):
            out.append(model(make_batch(ds, idx[start : start + size]))[2].numpy())
    return np.concatenate(out) if out else np.zeros(0)


def folds(ds: StepGraphDataset, cfg: DictConfig) -> list[tuple[str, str, np.ndarray]]:
    """(kind, held-out value, test mask) for every CV fold."""
    out = []
    if cfg.cv.gpus:
        for gpu in sorted(ds.rows["gpu_id"].unique()):
            out.append(("gpu", gpu, (ds.rows["gpu_id"] == gpu).to_numpy()))
    if cfg.cv.families:
        for fam in FAMILY_FOLDS:
            mask = (ds.rows["family"] == fam).to_numpy()
            if mask.any() and (~mask).any():
                out.append(("family", fam, mask))
    return out


class FoldData:
    """Each fold's dataset: rows featurised with per-op heads that never saw the fold's GPU.

    With roofline per-op times (nothing learned from kernel rows) every fold uses ``ds``.
    """

    def __init__(self, ds: StepGraphDataset, cfg: DictConfig) -> None:
        self.ds = ds
        self.heads = None
        self._none: StepGraphDataset | None = None
        if ds.per_op == "per-op":
            from training.fold_heads import FoldHeads

            fh = cfg.fold_heads
            self.heads = FoldHeads.from_train_ops(
                n_jobs=int(fh.n_jobs), cache_dir=fh.cache_dir and Path(fh.cache_dir),
                log=lambda m: print(f"  {m}", flush=True),
            )  # fmt: skip

    def held_out(self, gpu: str | None) -> str:
        """What the fold's per-op heads hold out (for the table)."""
        if self.heads is None:
            return f"none ({self.ds.per_op}: no kernel rows)"
        key = self.heads.key(gpu)
        return f"{key} kernel rows" if key == gpu else "none (all kernel GPUs)"

    def dataset(self, gpu: str | None) -> StepGraphDataset:
        if self.heads is None:
            return self.ds
        key = self.heads.key(gpu)
        if key == gpu:
            return self.ds.with_per_op("per-op", heads_function(self.heads.without(gpu)))
        if self._none is None:  # shared by the folds whose GPU has no kernel rows
            self._none = self.ds.with_per_op("per-op", heads_function(self.heads.without(None)))
        return self._none


def cross_validate(ds: StepGraphDataset, cfg: DictConfig) -> pd.DataFrame:
    """Held-out predictions: one row per (fold, held-out measurement), GNN and baseline."""
    data = FoldData(ds, cfg)
    parts = []
    for k, (kind, held, mask) in enumerate(folds(ds, cfg)):
        started = time.perf_counter()
        gpu = held if kind == "gpu" else None
        fold = data.dataset(gpu)
        train, test = np.flatnonzero(~mask), np.flatnonzero(mask)
        model = train_model(fold, train, cfg)
        pred = predict_rows(model, fold, test)
        parts.append(pd.DataFrame({"kind": kind, "held_out": held, "row": test, "gnn_ms": pred,
                                   "baseline_ms": fold.rows["baseline_ms"].to_numpy()[test],
                                   "heads_held_out": data.held_out(gpu)}))  # fmt: skip
        err = mape(pred, ds.rows["target_ms"].to_numpy()[test])
        print(f"  fold {k + 1}: {kind}={held} ({len(test)} rows): GNN {err:.1f}% "
              f"in {time.perf_counter() - started:.0f} s", flush=True)  # fmt: skip
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()


def joined(ds: StepGraphDataset, preds: pd.DataFrame) -> pd.DataFrame:
    """CV predictions with each row's measurement, family, AMP, source and cell."""
    p = preds.join(ds.rows[["target_ms", "family", "amp", "source"]], on="row")
    return p.assign(cell=[regime(f, a) for f, a in zip(p["family"], p["amp"], strict=True)])


def log_to_mlflow(
    cfg: DictConfig,
    table: pd.DataFrame,
    preds: pd.DataFrame,
    manifest: dict[str, Any],
    model: StepGNN | GnnEnsemble,
    artifact_dir: Path,
) -> str | None:
    """One run with params, CV metrics and the packaged model, registered by name."""
    import mlflow

    from training import registry  # the per-op models' store setup, shared

    root = cfg.mlflow.artifact_root and Path(cfg.mlflow.artifact_root).resolve().as_uri()
    registry.setup(cfg.mlflow.tracking_uri, cfg.mlflow.experiment, root or None)
    mlflow.set_experiment(cfg.mlflow.experiment)
    with mlflow.start_run(run_name="train_gnn") as run:
        mlflow.log_params({"per_op": manifest["per_op"], "rows": manifest["data"]["rows"],
                           **{f"model.{k}": v for k, v in cfg.model.items()},
                           **{f"train.{k}": v for k, v in cfg.train.items()}})  # fmt: skip
        for _, r in table.iterrows():
            key = (
                r["held out"].replace("=", "_").replace(" ", "_").replace("(", "").replace(")", "")
            )
            mlflow.log_metric(f"mape_gnn.{key}", r["GNN MAPE %"])
            mlflow.log_metric(f"mape_per_op.{key}", r["sum-of-per-op MAPE %"])
        mlflow.log_metric("train_seconds", manifest["train_seconds"])
        mlflow.log_text(markdown(table), "cv_table.md")
        mlflow.log_text(preds.to_csv(index=False), "cv_predictions.csv")
        mlflow.log_artifacts(str(artifact_dir), "gnn_artifact")
        if cfg.mlflow.register:
            mlflow.pytorch.log_model(model, name="gnn", pip_requirements=["torch", "torch-geometric"], serialization_format="pickle",
                                     registered_model_name=cfg.mlflow.model_name)  # fmt: skip
        return run.info.run_id


def run(cfg: DictConfig) -> dict[str, Any]:
    """Dataset → CV → final fit → package → MLflow; returns the manifest."""
    from data_collection.schema import load_steps
    from training.held_out import drop_held_out

    torch.set_num_threads(int(cfg.threads))
    started = time.perf_counter()
    data_cfg = OmegaConf.to_container(cfg.data, resolve=True)
    ds = build_dataset(drop_held_out(load_steps(), "step"), data_cfg, per_op=cfg.per_op)
    t_data = time.perf_counter() - started
    preds = cross_validate(ds, cfg)
    table, cells, coverage, use, interval = pd.DataFrame(), pd.DataFrame(), pd.DataFrame(), {}, {}
    if len(preds):
        p = joined(ds, preds)
        use, cells = decide(p)
        interval = intervals.calibrate(p, use)
        held = intervals.held_out_coverage(p, use)
        table = cv_table(p, held)
        coverage = intervals.coverage_table(held)
    t_cv = time.perf_counter() - started - t_data
    model = train_model(ds, np.arange(len(ds)), cfg)
    train_seconds = time.perf_counter() - started - t_data
    print(f"\nCV: mean abs % error of step time, held-out rows (per-op times: {ds.per_op})")
    print(markdown(table) if len(table) else "(no folds)")
    print("\nWhere the predictor uses the GNN (pooled held-out-GPU rows per cell; other/*: "
          "held-out-family rows)")  # fmt: skip
    print(markdown(cells) if len(cells) else "(no folds)")
    print("\nHeld-out coverage of the calibrated 80 % interval (p10-p90) of the method used; "
          "each GPU's rows scored with the interval calibrated on the other GPUs' folds, "
          "at the level chosen on them")  # fmt: skip
    print(markdown(coverage) if len(coverage) else "(no folds)")
    print("packaged 80 % interval (all held-out-GPU folds; estimate x p10 .. x p90; family "
          f"lines where its rows span >= {intervals.MIN_GPUS} GPUs):")  # fmt: skip
    print(intervals.describe(interval) if interval else "(no folds)")
    if len(preds):
        print("\nHeld-out predictions per measuring run (training/run_bias.py; median log "
              "predicted / measured, > 0: too slow):")  # fmt: skip
        print(run_bias.run_table(preds, ds.rows).round(2).to_string(index=False))
    print(f"dataset {t_data:.0f} s (tracing {ds.trace_seconds:.0f} s), CV {t_cv:.0f} s, "
          f"CV + final fit {train_seconds:.0f} s")  # fmt: skip
    manifest = {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "feature_version": FEATURE_VERSION,
        "per_op": ds.per_op,
        "model": OmegaConf.to_container(cfg.model),
        "train": OmegaConf.to_container(cfg.train),
        "use_gnn": use,
        "decision": cells.to_dict(orient="records"),
        "interval": {
            **interval,
            "levels": list(intervals.quantile_levels(interval["per-op"]["level"])),
            "fitted_on": "log(measured/estimated) of the leave-one-GPU-out CV predictions "
            "(per-op heads without the held-out GPU), each GPU weighted equally, at the "
            f"narrowest central level whose leave-one-GPU-out intervals hold "
            f">= {intervals.TARGET:.0%} of the held-out rows; "
            "per-op: baseline of every row, gnn: rows of cells that use the GNN; "
            f"by_family: the same per model family, where its rows span >= {intervals.MIN_GPUS} "
            "held-out GPUs (else the method's interval applies)",
        },
        "cv_coverage": coverage.to_dict(orient="records"),
        "data": {
            "rows": len(ds),
            "graphs": len(ds.graphs),
            "config": data_cfg,
            "rows_by_source": ds.rows.groupby("source").size().to_dict(),
            "gpus": sorted(ds.rows["gpu_id"].unique()),
            "excluded": ds.excluded,
        },  # fmt: skip
        "cv": table.to_dict(orient="records"),
        "train_seconds": round(train_seconds, 1),
        "versions": {"torch": torch.__version__, "torch_geometric": _pyg_version()},
    }
    out = Path(cfg.artifact_dir) if cfg.artifact_dir else ARTIFACT_DIR
    if cfg.save:
        save_model(model, manifest, out)
        (out / "cv_table.md").write_text(
            "\n\n".join(markdown(t) for t in (table, cells, coverage) if len(t)) + "\n"
        )
        print(f"packaged to {out}")
    if cfg.mlflow.enabled:
        held = preds.join(ds.rows[["source", "gpu_id", "model", "target_ms"]], on="row")
        run_id = log_to_mlflow(cfg, table, held, manifest, model, out)
        print(f"MLflow run {run_id}")
    return manifest


def _pyg_version() -> str:
    import torch_geometric

    return torch_geometric.__version__


def main() -> None:
    if print_help_if_asked(__doc__, "train_gnn"):
        return
    from boom_ml.predict import exit_on_bad_overrides

    exit_on_bad_overrides(sys.argv[1:], "train_gnn")  # one line, not Hydra's

    def _entry(cfg: DictConfig) -> None:
        with one_line_errors():
            run(cfg)

    hydra.main(config_path=CONFIG_DIR, config_name="train_gnn", version_base=None)(_entry)()


if __name__ == "__main__":
    main()
