"""What the size floor (``boom_ml/timing/size_floor.py``) does to measured kernel rows.

    python -m training.size_floor_check [gpus=[t4,l4]] [heads=packaged]

For each GPU with elementwise, norm, softmax or convolution kernel rows, that GPU's fold heads
(trained without any of its kernel rows, ``training/fold_heads.py``; cached) predict its rows of
those heads three ways: as the heads give them, raised to the shipped floor (one element; a
convolution: one image), and raised to the most the heads give at any smaller power of two (the
one-element floor's first version, a monotone envelope, kept here to show why it was replaced;
"-" for convolutions, which never had it). The table is MAPE % and the share of rows each floor
raised. ``heads=packaged`` scores the packaged heads on their own training rows
instead (in-sample: how much a floor moves a fitted model). The floor is not fitted; this
prints what it costs or gains where a measurement says, for the README.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from boom_ml.gpus import get_gpu
from boom_ml.timing.features import heads_of, kernel_features
from boom_ml.timing.size_floor import CONV_HEAD, SIZED_HEADS, Predictor, smallest_rows
from training.kernel_checks import ROW_COLUMNS, entry, gpu_list, mape, parse_arguments

FLOORED_HEADS = SIZED_HEADS | {CONV_HEAD}


def every_smaller_size(rows: pd.DataFrame, model: Predictor, spec) -> np.ndarray:
    """The first version's floor: the most ``model`` gives each row's op at any power of two
    below its size (elements; rows for a row-wise op), each row's one-element copy scaled up.
    Convolutions are left at 0 (no first version)."""
    small, source = smallest_rows(rows)
    sized = np.isin(heads_of(small), list(SIZED_HEADS)) if not small.empty else []
    small, source = small[sized].reset_index(drop=True), source[sized]
    best = np.zeros(len(rows))
    if small.empty:
        return best
    count = np.where(small["cols"].to_numpy(dtype=float) > 1, rows["numel"].to_numpy()[source]
                     / small["cols"].to_numpy(dtype=float), rows["numel"].to_numpy()[source])  # fmt: skip
    size = 1.0
    while (alive := size < count).any():
        copy = small[alive].copy()
        unit = copy["numel"].to_numpy(dtype=float)  # one element, or one row's length
        copy["numel"] = unit * size
        if "rows" in copy.columns:
            row_wise = copy["cols"].to_numpy(dtype=float) > 1
            copy["rows"] = np.where(row_wise, size, copy["rows"])
            copy["cols"] = np.where(row_wise, copy["cols"], size)
        ms = model.predict_features(kernel_features(copy, spec))["pred_ms"].to_numpy()
        np.maximum.at(best, source[alive], ms)
        size *= 2
    return best


def check(kernels: pd.DataFrame, heads_for, gpus: list[str] | None = None) -> pd.DataFrame:
    """One row per (GPU, head): rows, MAPE with no floor, the shipped one and every-size's,
    and the % of rows each floor raised. ``heads_for(gpu)``: the model that scores ``gpu``."""
    head = heads_of(kernels)
    keep = np.isin(head, list(FLOORED_HEADS))
    sized = kernels[keep].assign(head=head[keep])
    out = []
    for gpu in gpus or sorted(sized["gpu_id"].astype(str).unique()):
        rows = sized[sized["gpu_id"].astype(str) == gpu]
        if rows.empty:
            continue
        model, spec = heads_for(gpu), get_gpu(gpu)
        canon = rows[[c for c in ROW_COLUMNS if c in rows.columns]].reset_index(drop=True)
        plain = model.predict_features(kernel_features(canon, spec))["pred_ms"].to_numpy()
        floored = model.predict_rows(canon, spec)["pred_ms"].to_numpy()
        envelope = np.maximum(plain, every_smaller_size(canon, model, spec))
        measured = rows["latency_ms"].to_numpy(dtype=float)
        for h in sorted(rows["head"].unique()):
            m = rows["head"].to_numpy() == h
            first = h != CONV_HEAD  # the every-size envelope is the elementwise floor's
            out.append({"gpu": gpu, "head": h, "rows": int(m.sum()),
                        "mape_heads": round(mape(plain[m], measured[m]), 1),
                        "mape_floor": round(mape(floored[m], measured[m]), 1),
                        "mape_every_size": round(mape(envelope[m], measured[m]), 1) if first else "-",
                        "raised_floor_pct": round(100 * float(np.mean(floored[m] > plain[m])), 1),
                        "raised_every_size_pct": round(100 * float(np.mean(envelope[m] > plain[m])), 1) if first else "-"})  # fmt: skip
        print(f"{gpu}: scored", flush=True)
    return pd.DataFrame(out)


def main(argv: list[str]) -> None:
    from boom_ml.errors import InvalidInputError
    from boom_ml.timing.heads import load_model
    from training.fold_heads import FoldHeads

    usage = "training.size_floor_check [gpus=[a,b]] [heads=folds|packaged]"
    args = parse_arguments(argv, usage, ("gpus", "heads"))
    if args.get("heads", "folds") not in ("folds", "packaged"):
        raise InvalidInputError(f"heads must be folds or packaged: python -m {usage}")
    gpus, packaged = gpu_list(args.get("gpus")), args.get("heads") == "packaged"
    folds = FoldHeads.from_train_ops()
    table = check(folds.kernels, (lambda _g: load_model()) if packaged else folds.without, gpus)
    what = "the packaged heads on their own training rows" if packaged else (
        "each GPU's rows held out (its fold heads)")  # fmt: skip
    print(f"\nkernel rows of the floored heads, {what}; MAPE % with no floor, the shipped")
    print("floor (one element; conv: one image) and every smaller size's (first version), and")
    print("% of rows each raised:")
    print(table.to_string(index=False))


if __name__ == "__main__":
    entry(__doc__, main)
