"""How near the kernel measurements behind a time estimate come to the target GPU.

The per-op models learn from kernels timed on a few GPUs (the packaged model's
``rows_per_gpu``). A prediction for one of them, or for a sibling of the same architecture,
interpolates; for a GPU whose architecture no measured GPU shares (Hopper, Blackwell today)
every learned correction comes from other silicon. The README's "A generation nobody
measured" check puts a number on that case; the report says which case a prediction is.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterable, Mapping

import pandas as pd

from boom_ml.gpus import get_gpu
from boom_ml.gpus.spec import GpuSpec
from boom_ml.trace.graph import reads_dtype

# Tensor-core heads whose half-precision rows cover few architectures (the manifest's
# rows_per_head_dtype): fp16 GEMMs Pascal, Volta, Turing and Ampere; fp16 convolutions
# Pascal, Volta and Turing only. bf16 was never measured: the heads time it from fp16 rows.
HALF_KINDS = {"gemm": "GEMMs", "conv": "convolutions"}
HALF = "fp16/bf16 "  # how unmeasured_half names a kind

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


def half_coverage(model: str | None = None) -> dict[str, frozenset[str]]:
    """Per head of :data:`HALF_KINDS`, the GPU ids whose fp16 rows trained it ({} when the
    model does not record them: a model packaged before the record)."""
    from boom_ml.errors import ArtifactError
    from boom_ml.timing.heads import load_model

    try:
        rows = load_model(model).meta.get("rows_per_head_dtype") or {}
    except (ArtifactError, FileNotFoundError, OSError):
        return {}
    return {head: frozenset((rows.get(head) or {}).get("float16") or {}) for head in HALF_KINDS
            if rows}  # fmt: skip


def half_kinds(nodes: pd.DataFrame) -> list[str]:
    """The heads of :data:`HALF_KINDS` whose nodes in ``nodes`` take fp16 or bf16 inputs."""
    half = reads_dtype(nodes, ("float16", "bfloat16"))
    return [head for head in HALF_KINDS if (half & (nodes["family"] == head)).any()]


def unmeasured_half(
    gpu: GpuSpec, kinds: Collection[str], coverage: Mapping[str, frozenset[str]]
) -> list[str]:
    """Of the half-precision ``kinds`` a step runs, those no GPU of ``gpu``'s architecture had
    measured in fp16 ("fp16/bf16 GEMMs", "fp16/bf16 convolutions"; all of them on an
    architecture nobody measured): the heads time them from other silicon. Empty without a
    coverage record."""
    return [f"{HALF}{HALF_KINDS[k]}" for k in kinds if k in coverage
            and gpu.architecture not in _architectures(tuple(sorted(coverage[k])))]  # fmt: skip


def half_text(gaps: Iterable[str], joiner: str = "and", prefix: str = HALF) -> str:
    """:func:`unmeasured_half`'s list as a phrase: "fp16/bf16 GEMMs and convolutions"."""
    return prefix + f" {joiner} ".join(g.removeprefix(HALF) for g in gaps)
