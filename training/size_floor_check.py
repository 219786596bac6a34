"""What the size floor (``boom_ml/timing/size_floor.py``) does to held-out kernel rows.

    python -m training.size_floor_check [gpus=[t4,l4]]

For each GPU with elementwise, norm or softmax kernel rows: that GPU's fold heads (trained
without any of its kernel rows, ``training/fold_heads.py``; cached) predict its rows of those
heads, once as the heads give them and once raised to the size floor; the table is MAPE % and
the share of rows the floor raised. The floor is not fitted and was adopted on its reasoning
(an op is not faster on a larger tensor); this prints what it costs or gains where a
measurement says, so that the README can show it.
"""

from __future__ import annotations

import sys

import numpy as np
import pandas as pd

from boom_ml.gpus import get_gpu
from boom_ml.timing.features import FAMILY_HEAD, kernel_features
from boom_ml.timing.size_floor import SIZED_HEADS

# The columns a kernel row is featurised from: the rest (latency, versions, kernel names)
# would make every row distinct and the floor's smaller copies with them.
ROW_COLUMNS = ["source", "op", "family", "dtype", "direction", "numel", "rows", "cols"]


def mape(pred: np.ndarray, measured: np.ndarray) -> float:
    return float(100 * np.mean(np.abs(pred - measured) / measured))


def check(kernels: pd.DataFrame, fold_heads, gpus: list[str] | None = None) -> pd.DataFrame:
    """One row per (held-out GPU, head): rows, MAPE without and with the floor, % raised."""
    head = kernels["family"].astype(str).map(FAMILY_HEAD).fillna("elementwise")
    sized = kernels[head.isin(list(SIZED_HEADS)).to_numpy()].assign(head=head)
    out = []
    for gpu in gpus or sorted(sized["gpu_id"].astype(str).unique()):
        rows = sized[sized["gpu_id"].astype(str) == gpu]
        if rows.empty:
            continue
        model = fold_heads.without(gpu)
        spec = get_gpu(gpu)
        canon = rows[[c for c in ROW_COLUMNS if c in rows.columns]].reset_index(drop=True)
        plain = model.predict_features(kernel_features(canon, spec))["pred_ms"].to_numpy()
        floored = model.predict_rows(canon, spec)["pred_ms"].to_numpy()
        measured = rows["latency_ms"].to_numpy(dtype=float)
        for h in sorted(rows["head"].unique()):
            m = rows["head"].to_numpy() == h
            out.append({"held_out_gpu": gpu, "head": h, "rows": int(m.sum()),
                        "mape_heads": round(mape(plain[m], measured[m]), 1),
                        "mape_floored": round(mape(floored[m], measured[m]), 1),
                        "raised_pct": round(100 * float(np.mean(floored[m] > plain[m])), 1)})  # fmt: skip
        print(pd.DataFrame(out[-len(rows["head"].unique()) :]).to_string(index=False), flush=True)
    return pd.DataFrame(out)


def main(argv: list[str]) -> None:
    from training.fold_heads import FoldHeads

    gpus = None
    for arg in argv:
        key, _, value = arg.partition("=")
        if key != "gpus":
            raise SystemExit(
                f"unknown key {key!r}: python -m training.size_floor_check [gpus=[a,b]]"
            )
        gpus = [g.strip() for g in value.strip("[]").split(",") if g.strip()]
    folds = FoldHeads.from_train_ops()
    table = check(folds.kernels, folds, gpus)
    print("\nheld-out kernel rows of the sized heads, MAPE % (fold heads; floor off -> on):")
    print(table.to_string(index=False))


if __name__ == "__main__":
    main(sys.argv[1:])
