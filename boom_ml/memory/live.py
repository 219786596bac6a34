"""Live-tensor accounting: the bytes of tensors alive at each event, as PyTorch's
FakeTensor-based estimators count them, with the allocator's 512-byte rounding."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from boom_ml.trace.graph import MEMORY_CATEGORIES

MIN_BLOCK = 512


def round_block(nbytes: np.ndarray | int) -> np.ndarray | int:
    """Round a request up to the allocator's 512-byte granularity (0 stays 0)."""
    return (np.asarray(nbytes) + MIN_BLOCK - 1) // MIN_BLOCK * MIN_BLOCK


@dataclass
class LivePeak:
    peak_bytes: int
    peak_index: int  # row of mem_events at which the peak is first reached
    timeline: np.ndarray  # live rounded bytes after each event
    breakdown: dict[str, int]  # category → live rounded bytes at the peak


def live_peak(events: pd.DataFrame) -> LivePeak:
    """Peak of live rounded bytes over the event list, with a category breakdown."""
    if events.empty:
        return LivePeak(0, -1, np.zeros(0, dtype=np.int64), {})
    size = round_block(events["bytes"].to_numpy(dtype=np.int64))
    sign = np.where(events["action"].to_numpy() == "alloc", 1, -1)
    timeline = np.cumsum(size * sign)
    index = int(np.argmax(timeline))
    return LivePeak(int(timeline[index]), index, timeline, breakdown_at(events, index))


def breakdown_at(events: pd.DataFrame, index: int) -> dict[str, int]:
    """Bytes by category of the blocks alive just after event ``index``."""
    upto = events.iloc[: index + 1]
    size = round_block(upto["bytes"].to_numpy(dtype=np.int64))
    signed = pd.Series(np.where(upto["action"].to_numpy() == "alloc", size, -size))
    by_cat = signed.groupby(upto["category"].to_numpy()).sum()
    return {c: int(by_cat.get(c, 0)) for c in MEMORY_CATEGORIES}


def held_for_backward(events: pd.DataFrame) -> int:
    """Rounded bytes a forward leaves for its backward: the activations alive when the backward
    starts. Each micro-batch a pipeline stage has in flight holds this much; the peak's own
    activations are another moment's (mid-backward, part freed). Autocast's copies of the
    weights are not counted: a pipeline schedule runs inside one autocast region (the
    harness's, torchtitan's), whose cache casts each weight once for every micro-batch, and
    the traced step holds them already (a further micro-batch of Llama-3-8B had been charged
    its stage's 6.5 GiB of bf16 copies again)."""
    back = np.flatnonzero(events["phase"].isin(("backward", "recompute")).to_numpy())
    if not len(back) or back[0] == 0:
        return 0
    at = breakdown_at(events, int(back[0]) - 1)
    return at["activation"]
