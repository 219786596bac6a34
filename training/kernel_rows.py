"""The canonical kernel rows every per-op model trains on, as ``configs/train_ops.yaml`` names them.

``train_ops`` (the heads), ``train_gemm`` (the tile/wave GEMM model) and ``fold_heads`` (the
CV folds' models) all start here, so that an excluded GPU or a Hopper row (``held_out.py``)
is left out of every one of them alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from boom_ml import config_help

CONFIG_DIR = str(config_help.CONFIG_DIR)


def train_ops_config() -> dict[str, Any]:
    """``configs/train_ops.yaml`` as a plain dict (its defaults, no overrides)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(Path(CONFIG_DIR) / "train_ops.yaml"), resolve=True)


def load_training_data(data: dict[str, Any], log: Any = print) -> pd.DataFrame:
    """Canonical kernel rows minus excluded GPUs (each exclusion printed with its reason)
    and minus every Hopper row (``training/held_out.py``)."""
    from data_collection.schema import load_kernels
    from training.held_out import drop_held_out

    kernels = drop_held_out(load_kernels(data.get("dir"), data.get("sources")), "kernel", log)
    for gpu, reason in (data.get("exclude_gpus") or {}).items():
        drop = kernels["gpu_id"] == gpu
        if drop.any():
            log(f"excluded {int(drop.sum())} rows of {gpu}: {' '.join(str(reason).split())}")
        else:  # a misspelt id (+data.exclude_gpus.<gpu>=why) would exclude nothing unsaid
            log(f"data.exclude_gpus.{gpu}: no kernel rows of {gpu!r}, nothing excluded "
                f"(GPUs with rows: {', '.join(sorted(kernels['gpu_id'].astype(str).unique()))})")  # fmt: skip
        kernels = kernels[~drop]
    cap = data.get("max_rows_per_head")
    if cap:
        from boom_ml.timing.features import FAMILY_HEAD

        # Stratified by GPU, so that a small run still holds every GPU (the L4 has ~2 % of
        # the GEMM rows and would vanish from a plain random sample).
        head = kernels["family"].map(FAMILY_HEAD)
        per_gpu = (int(cap) // kernels.groupby(head)["gpu_id"].transform("nunique")).clip(lower=1)
        rank = (
            kernels.sample(frac=1.0, random_state=0).groupby([head, kernels["gpu_id"]]).cumcount()
        )
        kernels = kernels[rank.reindex(kernels.index) < per_gpu]
    return kernels.reset_index(drop=True)
