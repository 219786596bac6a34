"""How far apart repeated measurements of the same step are: the error floor of any predictor.

``python -m training.step_spread`` groups the single-GPU CNN step rows (cnn_step_times) by
model and precision on one GPU, and on one GPU chip (cards built on the same die), across the
runs that measured them, and prints the error of the best single prediction for each
configuration: the value x minimising the mean of |measured - x| / measured over its runs,
which is the median of the runs weighted by 1 / measured. A model that knows only the GPU,
the model and the precision cannot do better than this on those rows, however it is fitted.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

# Cards on the same die (NVIDIA's Turing and Pascal architecture whitepapers: the GeForce RTX
# 2080 Ti and the TITAN RTX are both TU102; the GeForce GTX 1080 Ti and the TITAN Xp, GP102).
CHIPS = {"rtx-2080-ti": "TU102", "titan-rtx": "TU102", "gtx-1080-ti": "GP102",
         "titan-xp": "GP102"}  # fmt: skip
PRECISIONS = ("float32", "float16")


def best_single_mape(values: np.ndarray) -> float:
    """Mean of |v - x| / v (in %) at the x that minimises it: the 1/v-weighted median of v."""
    v = np.sort(np.asarray(values, dtype=float))
    w = 1.0 / v
    cum = np.cumsum(w)
    x = v[np.searchsorted(cum, cum[-1] / 2)]
    return float(100 * np.mean(np.abs(v - x) / v))


def runs(steps: pd.DataFrame) -> pd.DataFrame:
    """Single-GPU cnn_step_times rows with a run label (script version and result folder)."""
    s = steps[(steps["source"] == "cnn_step_times") & (steps["num_gpus"] == 1)
              & steps["precision"].isin(PRECISIONS)].copy()  # fmt: skip
    folder = s["source_path"].str.extract(r"results/([^/]+)/")[0]
    return s.assign(run=s["run_id"].astype(str) + "|" + folder)


def spread(rows: pd.DataFrame, group: str) -> pd.DataFrame:
    """Per value of ``group`` ("gpu_id" or "chip"): configurations measured by >= 2 runs,
    how many runs, and the mean best-single-prediction error over those configurations."""
    lines = []
    for name, sub in rows.groupby(group, sort=True):
        per_config = sub.groupby(["model", "precision"])["step_time_ms"]
        multi = [g.to_numpy() for _, g in per_config if len(g) >= 2]
        if not multi:
            continue
        lines.append({group: name, "runs": sub["run"].nunique(), "configs": len(multi),
                      "best single prediction MAPE %":
                          round(float(np.mean([best_single_mape(v) for v in multi])), 1)})  # fmt: skip
    return pd.DataFrame(lines)


def main() -> None:
    from data_collection.schema import load_steps

    rows = runs(load_steps())
    rows = rows.assign(chip=rows["gpu_id"].map(CHIPS))
    by_chip = rows.dropna(subset=["chip"]).assign(run=lambda d: d["gpu_id"] + "|" + d["run"])
    print("Repeated runs of one GPU (cnn_step_times, single GPU, fp32 and fp16):")
    print(spread(rows, "gpu_id").to_string(index=False))
    print("\nRuns of cards on the same die (TU102: RTX 2080 Ti + TITAN RTX; GP102: GTX 1080 Ti "
          "+ TITAN Xp):")  # fmt: skip
    print(spread(by_chip, "chip").to_string(index=False))


if __name__ == "__main__":
    from boom_ml.config_help import doc_help_or_no_args, one_line_errors

    if not doc_help_or_no_args(__doc__):
        with one_line_errors():
            main()
