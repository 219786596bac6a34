"""What the anchor cap (``boom_ml/timing/anchors.py``) does to measured kernel rows, held out.

    python -m training.anchor_check [gpus=[a100-80gb-pcie,v100-pcie-32gb]]

For each GPU with kernel rows that dominates at least one other measured GPU (at least as
good on every spec-sheet number), that GPU's fold models (heads and GEMM tile model trained
without any of its kernel rows, ``training/fold_heads.py``; cached) time its rows as a step
times them, with and without the cap; the anchors are the fold's own measured GPUs, so the
held-out GPU's rows never reach them. The table is MAPE % per head (GEMM rows: the tile
model) and the share of rows the cap lowered. A GPU that dominates no measured GPU is never
capped and is left out. Nothing is fitted; this prints what the cap costs or gains.
"""

from __future__ import annotations

import sys

import numpy as np
import pandas as pd

from boom_ml.gpus import get_gpu
from boom_ml.timing.anchors import dominates, time_kernel_rows, time_uncapped
from boom_ml.timing.features import heads_of
from training.size_floor_check import ROW_COLUMNS, mape

# the shape columns of GEMM rows beside the ones the size floor's check reads
COLUMNS = [*ROW_COLUMNS, "b", "m", "n", "k", "heads", "head_dim", "seq_q", "seq_kv"]


def check(kernels: pd.DataFrame, models_for, gpus: list[str] | None = None) -> pd.DataFrame:
    """One row per (GPU, head) and one per GPU (head ``all``): rows, MAPE uncapped and
    capped, % of rows lowered, and the anchors. ``models_for(gpu)``: the per-op model (with
    its ``.gemm``) that scores ``gpu``."""
    measured = sorted(kernels["gpu_id"].astype(str).unique())
    specs = {g: get_gpu(g) for g in measured}
    out = []
    for gpu in gpus or measured:
        anchors = [a for a in measured if a != gpu and dominates(specs[gpu], specs[a])]
        if not anchors:
            continue
        rows = kernels[kernels["gpu_id"].astype(str) == gpu]
        model = models_for(gpu)
        gemm = getattr(model, "gemm", None)
        canon = rows[[c for c in COLUMNS if c in rows.columns]].reset_index(drop=True)
        plain = time_uncapped(canon, [specs[gpu]], model, gemm)["pred_ms"].to_numpy()
        capped = time_kernel_rows(canon, specs[gpu], model, gemm)["pred_ms"].to_numpy()
        measured_ms = rows["latency_ms"].to_numpy(dtype=float)
        head = heads_of(canon)
        for name in [*sorted(set(head)), "all"]:
            m = head == name if name != "all" else np.ones(len(head), dtype=bool)
            out.append({"gpu": gpu, "head": name, "rows": int(m.sum()),
                        "mape_uncapped": round(mape(plain[m], measured_ms[m]), 1),
                        "mape_capped": round(mape(capped[m], measured_ms[m]), 1),
                        "lowered_pct": round(100 * float(np.mean(capped[m] < plain[m])), 1),
                        "anchors": ",".join(anchors)})  # fmt: skip
        print(f"{gpu}: scored", flush=True)
    return pd.DataFrame(out)


def main(argv: list[str]) -> None:
    from boom_ml.errors import InvalidInputError
    from training.fold_heads import FoldHeads

    gpus = None
    for arg in argv:
        key, _, value = arg.partition("=")
        if key != "gpus":
            raise InvalidInputError(
                f"unknown argument {arg!r}: python -m training.anchor_check [gpus=[a,b]] "
                "(--help says what it does)"
            )
        gpus = [g.strip() for g in value.strip("[]").split(",") if g.strip()]
    for gpu in gpus or []:
        get_gpu(gpu)  # an unknown id is one line, not an empty table
    folds = FoldHeads.from_train_ops()
    table = check(folds.kernels, folds.without, gpus)
    print("\nkernel rows, each GPU's rows held out (its fold heads and GEMM model); MAPE % without")
    print("and with the anchor cap, and % of rows it lowered:")
    print(table.to_string(index=False))


if __name__ == "__main__":
    from boom_ml.config_help import help_requested, one_line_errors

    if help_requested(sys.argv[1:]):
        print(__doc__.strip())
    else:
        with one_line_errors():
            main(sys.argv[1:])
