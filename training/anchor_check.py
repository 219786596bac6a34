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

import numpy as np
import pandas as pd

from boom_ml.gpus import get_gpu
from boom_ml.timing.anchors import dominates, time_kernel_rows, time_uncapped
from boom_ml.timing.features import heads_of
from training.kernel_checks import ROW_COLUMNS, entry, held_out_table, mape


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
        canon = rows[[c for c in ROW_COLUMNS if c in rows.columns]].reset_index(drop=True)
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
    table = held_out_table(argv, "training.anchor_check [gpus=[a,b]]", check)
    print("\nkernel rows, each GPU's rows held out (its fold heads and GEMM model); MAPE % without")
    print("and with the anchor cap, and % of rows it lowered:")
    print(table.to_string(index=False))


if __name__ == "__main__":
    entry(__doc__, main)
