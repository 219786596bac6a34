"""How near the kernel measurements behind a time estimate come to the target GPU.

The per-op models learn from kernels timed on a few GPUs (the packaged model's
``rows_per_gpu``). A prediction for one of them, or for a sibling of the same architecture,
interpolates; for a GPU whose architecture no measured GPU shares (Hopper, Blackwell today)
every learned correction comes from other silicon. The README's "A generation nobody
measured" check puts a number on that case; the report says which case a prediction is.
"""

from __future__ import annotations

import functools
from collections.abc import Collection

from boom_ml.gpus import get_gpu
from boom_ml.gpus.spec import GpuSpec

MEASURED = "measured"  # the GPU's own kernels are in the training data
ARCHITECTURE = "architecture measured"  # another GPU of its architecture's are
UNMEASURED = "architecture not measured"  # no GPU of its architecture was measured


def measured_gpus(model: str | None = None) -> list[str]:
    """GPU ids whose kernel rows trained the per-op heads (``model``: as ``heads.load_model``
    takes it, None the packaged default; [] without heads or without that record)."""
    from boom_ml.errors import ArtifactError
    from boom_ml.timing.heads import load_model

    try:
        meta = load_model(model).meta
    except (ArtifactError, FileNotFoundError, OSError):
        return []
    return sorted(meta.get("rows_per_gpu") or {})


def basis(gpu: GpuSpec, measured: Collection[str]) -> str:
    """:data:`MEASURED`, :data:`ARCHITECTURE` or :data:`UNMEASURED` for ``gpu``."""
    if gpu.id in measured and get_gpu(gpu.id) == gpu:  # not a user spec that took its id
        return MEASURED
    return ARCHITECTURE if gpu.architecture in _architectures(tuple(measured)) else UNMEASURED


@functools.lru_cache(maxsize=8)
def _architectures(measured: tuple[str, ...]) -> frozenset[str]:
    """The architectures of the measured GPUs (a layout search asks for every candidate)."""
    return frozenset(get_gpu(g).architecture for g in measured)
