"""Which model should time a GEMM of each dtype: the gemm head or the tile/wave model, held out.

    python -m training.gemm_routing [gpus=[a40,t4]]

For each GPU with GEMM kernel rows, its fold models (the heads and the tile/wave GEMM model,
trained without any of that GPU's kernel rows, ``training/fold_heads.py``; cached) time every
one of its GEMM rows both ways. The table is MAPE % per GPU, dtype and source, then the mean
over GPUs per dtype, which ``boom_ml/timing/gemm.py: TILE_DTYPES`` follows (the tile model
times the dtypes where its mean is lower; the head the others).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from boom_ml.gpus import get_gpu
from boom_ml.timing.features import heads_of
from training.kernel_checks import ROW_COLUMNS, entry, held_out_table, mape


def compare(kernels: pd.DataFrame, models_for, gpus: list[str] | None = None) -> pd.DataFrame:
    """One row per (GPU, dtype, source): rows, MAPE of the head and of the tile model.
    ``models_for(gpu)``: the per-op model (with its ``.gemm``) that scores ``gpu``."""
    from training.train_gemm import gemm_rows

    rows_all = gemm_rows(kernels[heads_of(kernels) == "gemm"])
    out = []
    for gpu in gpus or sorted(rows_all["gpu_id"].astype(str).unique()):
        rows = rows_all[rows_all["gpu_id"].astype(str) == gpu].reset_index(drop=True)
        model = models_for(gpu)
        if rows.empty or getattr(model, "gemm", None) is None:
            continue
        spec = get_gpu(gpu)
        canon = rows[[c for c in ROW_COLUMNS if c in rows.columns]]
        head = model.predict_rows(canon, spec)["pred_ms"].to_numpy()
        tiles = model.gemm.predict_rows(canon, spec)["pred_ms"].to_numpy()
        measured = rows["latency_ms"].to_numpy(dtype=float)
        for (dtype, source), idx in rows.groupby(["dtype", "source"]).groups.items():
            i = np.asarray(idx)
            out.append({"gpu": gpu, "dtype": dtype, "source": source, "rows": len(i),
                        "head": round(mape(head[i], measured[i]), 1),
                        "tiles": round(mape(tiles[i], measured[i]), 1)})  # fmt: skip
        print(f"{gpu}: scored", flush=True)
    return pd.DataFrame(out)


def per_dtype(table: pd.DataFrame) -> pd.DataFrame:
    """Mean over GPUs of each GPU's MAPE on all its rows of a dtype (rows weighted within a
    GPU, GPUs alike), and which model is lower."""
    weighted = table.assign(h=table["head"] * table["rows"], t=table["tiles"] * table["rows"])
    per_gpu = weighted.groupby(["dtype", "gpu"])[["h", "t", "rows"]].sum()
    per_gpu["head"], per_gpu["tiles"] = (
        per_gpu["h"] / per_gpu["rows"],
        per_gpu["t"] / per_gpu["rows"],
    )
    mean = per_gpu.groupby("dtype").agg(
        gpus=("rows", "size"), head=("head", "mean"), tiles=("tiles", "mean")
    )
    mean["lower"] = np.where(mean["tiles"] < mean["head"], "tiles", "head")
    return mean.round(1)


def main(argv: list[str]) -> None:
    table = held_out_table(argv, "training.gemm_routing [gpus=[a,b]]", compare)
    print("\nGEMM kernel rows, each GPU's rows held out (its fold heads and GEMM model); MAPE %:")
    print(table.to_string(index=False))
    print("\nmean over GPUs per dtype (each GPU's rows of that dtype, GPUs weighed alike):")
    print(per_dtype(table).to_string())


if __name__ == "__main__":
    entry(__doc__, main)
