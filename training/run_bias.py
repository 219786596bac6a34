"""Held-out step predictions per measuring run: does an error follow the GPU or the run?

    python -m training.run_bias PATH/cv_predictions.csv

``train_gnn`` logs its leave-one-GPU-out predictions to MLflow (``cv_predictions.csv``) and
prints this table after its CV. For the step rows that name the run that measured them
(cnn_step_times: the script version and the result folder, each folder one machine and
date in its SOURCE.md), it gives the median log(predicted / measured) of the GNN and of the
per-op sum per run, GPU and precision: > 0 predicted too slow. Two cards of one die measured
a year apart with opposite signs is an error of the run (its software stack, its host), which
no GPU feature can take out.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd

RUN_SOURCES = ("cnn_step_times",)
# Month of each cnn_step_times run, by result folder (its SOURCE.md table; the 2018 script's
# runs, whatever the folder, are October 2018).
RUN_MONTHS = {"2080TI": "2020-01", "2080ti(2)": "2020-01", "TITANXP": "2021-01",
              "TitanRTX": "2021-01", "dgx-a100": "2021-01"}  # fmt: skip


def run_table(preds: pd.DataFrame, rows: pd.DataFrame) -> pd.DataFrame:
    """``preds``: train_gnn's CV predictions (``row`` indexes ``rows``, the GNN's step rows;
    columns the predictions lack are read from ``rows``)."""
    p = _runs(preds, rows)
    keys = ["run_id", "folder", "month", "gpu_id", "precision"]
    return (
        p.groupby(keys, sort=True)
        .agg(
            rows=("gnn", "size"),
            gnn_median_log=("gnn", "median"),
            per_op_median_log=("per_op", "median"),
        )  # fmt: skip
        .reset_index()
    )


def _runs(preds: pd.DataFrame, rows: pd.DataFrame) -> pd.DataFrame:
    need = ["source", "gpu_id", "target_ms", "run_id", "source_path", "precision"]
    p = preds[preds["kind"].eq("gpu")]
    p = p.join(rows[[c for c in need if c not in p.columns]], on="row")
    p = p[p["source"].isin(RUN_SOURCES)]
    folder = p["source_path"].astype(str).str.extract(r"results/([^/]+)/")[0]
    month = folder.map(RUN_MONTHS).where(~p["run_id"].astype(str).str.startswith("script2018"))
    return p.assign(folder=folder, month=month.fillna("2018-10"),
                    gnn=np.log(p["gnn_ms"] / p["target_ms"]),
                    per_op=np.log(p["baseline_ms"] / p["target_ms"]))  # fmt: skip


def month_corrected(preds: pd.DataFrame, rows: pd.DataFrame) -> pd.DataFrame:
    """Per held-out GPU: the GNN's MAPE, and its MAPE once each row's log error is reduced by
    the median of the *other* GPUs' held-out rows measured the same month in the same
    precision (none: unchanged). A post-hoc bound on what an input naming the run's software
    stack could buy, were the month all it carried; nothing is fitted to the GPU itself."""
    p = _runs(preds, rows)
    lines = []
    for gpu, sub in p.groupby("gpu_id", sort=True):
        others = p[p["gpu_id"] != gpu].groupby(["month", "precision"])["gnn"].median()
        keys = pd.MultiIndex.from_arrays([sub["month"], sub["precision"]])
        offset = others.reindex(keys).fillna(0.0).to_numpy()
        lines.append({"gpu": gpu, "rows": len(sub),
                      "gnn_mape": 100 * float(np.mean(np.abs(np.exp(sub["gnn"]) - 1))),
                      "month_corrected_mape":
                          100 * float(np.mean(np.abs(np.exp(sub["gnn"] - offset) - 1)))})  # fmt: skip
    return pd.DataFrame(lines)


def step_rows() -> pd.DataFrame:
    """The GNN's step rows, selected as ``configs/train_gnn.yaml`` selects them."""
    from omegaconf import OmegaConf

    from data_collection.schema import load_steps
    from training.graph_dataset import select_rows
    from training.held_out import drop_held_out
    from training.kernel_rows import CONFIG_DIR

    data = OmegaConf.to_container(OmegaConf.load(Path(CONFIG_DIR) / "train_gnn.yaml"))["data"]
    rows, _ = select_rows(drop_held_out(load_steps(), "step", lambda _m: None), data)
    return rows


def main(argv: list[str] | None = None) -> pd.DataFrame:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    try:
        preds = pd.read_csv(argv[0])
    except (OSError, pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as err:
        raise SystemExit(f"run_bias: cannot read {argv[0]} ({type(err).__name__})") from None
    wanted = {"kind", "row", "held_out", "gnn_ms"}
    if not wanted <= set(preds.columns):
        raise SystemExit(
            f"run_bias: {argv[0]} lacks {', '.join(sorted(wanted - set(preds.columns)))}: pass"
            " a train_gnn run's artifacts/cv_predictions.csv"
        )
    rows = step_rows()
    measured = rows["step_time_ms"].to_numpy(dtype=float)[preds["row"].to_numpy()]
    if "target_ms" in preds and not np.allclose(measured, preds["target_ms"], rtol=1e-6):
        raise SystemExit("run_bias: the CSV's rows are not today's GNN step rows (the data or "
                         "configs/train_gnn.yaml changed since it was written)")  # fmt: skip
    table = run_table(preds, rows)
    print(table.round(2).to_string(index=False))
    corrected = month_corrected(preds, rows)
    print("\nEach GPU's rows less the other GPUs' median error of the same month and precision:")
    print(corrected.round(1).to_string(index=False))
    print(f"mean over GPUs: GNN {corrected['gnn_mape'].mean():.1f} %, month-corrected "
          f"{corrected['month_corrected_mape'].mean():.1f} %")  # fmt: skip
    return table


if __name__ == "__main__":
    main()
