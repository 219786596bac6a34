"""Rows that no model may train on: every Hopper GPU's (H100, H200, H800, GH200).

The developers' brief keeps Hopper measurements out of training from any source: they are
how we measure "a GPU nobody here owns" (issue #13's H100 set; the H200 sweeps in
``data_collection/sweeps/``). The shared data hold none today; this guard keeps it so when
a measured Hopper dataset lands in ``data/canonical/`` by mistake. Training entries call
:func:`drop_held_out` on what they load, and ``training/hopper_check.py`` scores the
packaged models on exactly these rows.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd

HELD_OUT_ARCHITECTURES = frozenset({"hopper"})
# A device name no GPU-table row resolves still counts when it names a Hopper part.
_HOPPER_NAME = re.compile(r"\b(?:G?H[12]00|H800)\b", re.IGNORECASE)


@functools.cache
def _architecture(gpu_id: str) -> str | None:
    from boom_ml.errors import BoomError
    from boom_ml.gpus import get_gpu

    try:
        return get_gpu(gpu_id).architecture
    except BoomError:  # a GPU the table does not know: the device name decides
        return None


def held_out_mask(rows: pd.DataFrame) -> np.ndarray:
    """True where a row was measured on a Hopper GPU (by ``gpu_id``, else ``device_name``)."""
    if rows.empty:
        return np.zeros(0, dtype=bool)
    ids = rows["gpu_id"].astype(str) if "gpu_id" in rows else pd.Series("", index=rows.index)
    arch = ids.map(lambda g: _architecture(g) in HELD_OUT_ARCHITECTURES)
    names = rows["device_name"].astype(str) if "device_name" in rows else ids
    by_name = names.map(lambda n: bool(_HOPPER_NAME.search(n)))
    return (arch | by_name).to_numpy(dtype=bool)


def drop_held_out(rows: pd.DataFrame, what: str, log: Callable[[str], Any] = print) -> pd.DataFrame:
    """``rows`` without Hopper rows; says how many it dropped, and of which GPUs."""
    mask = held_out_mask(rows)
    if not mask.any():
        return rows
    gpus = ", ".join(sorted(rows.loc[mask, "gpu_id"].astype(str).unique()))
    log(f"held out of training: {int(mask.sum())} {what} rows of {gpus} (Hopper)")
    return rows[~mask].reset_index(drop=True)
