"""TF32 as PyTorch switches it: one flag for cuBLAS matmuls, one for cuDNN convolutions.

``torch.backends.cuda.matmul.allow_tf32`` is off by default since PyTorch 1.12 (on in
1.7-1.11); ``torch.backends.cudnn.allow_tf32`` has been on by default since 1.7. So an fp32
convolution on Ampere or later runs on TF32 tensor cores unless the user turns it off, while
an fp32 GEMM does not. On a GPU without TF32 (before Ampere) neither flag changes anything:
``GpuSpec.peak_flops`` and the per-op features fall back to the fp32 peak there.
"""

from __future__ import annotations

from dataclasses import dataclass

# Families whose kernels come from cuDNN (the cudnn flag); every other matrix family
# (gemm, attention: cuBLAS or SDPA's matmuls) follows the matmul flag.
CUDNN_FAMILIES = frozenset({"conv"})


@dataclass(frozen=True)
class Tf32:
    """Which fp32 matrix kernels may use TF32 (the PyTorch defaults when built bare)."""

    matmul: bool = False
    cudnn: bool = True

    @classmethod
    def of(cls, value: Tf32 | bool | None) -> Tf32:
        """``None``: PyTorch's defaults; ``True``/``False``: both flags (the old single flag)."""
        if value is None:
            return cls()
        if isinstance(value, Tf32):
            return value
        return cls(matmul=bool(value), cudnn=bool(value))

    def for_family(self, family: str) -> bool:
        """Whether an fp32 op of this family may run on TF32."""
        return self.cudnn if family in CUDNN_FAMILIES else self.matmul

    @property
    def any(self) -> bool:
        return self.matmul or self.cudnn


PYTORCH_DEFAULT = Tf32()


def from_torch_version(version: str) -> Tf32:
    """PyTorch's default flags in release ``version`` ("1.12.1", "2.1.0"; "" = unknown: the
    current defaults)."""
    parts = tuple(int(x) for x in version.split(".")[:2] if x.isdigit())
    if len(parts) < 2:
        return PYTORCH_DEFAULT
    if parts < (1, 7):  # no TF32 switches before 1.7
        return Tf32(matmul=False, cudnn=False)
    return Tf32(matmul=parts < (1, 12), cudnn=True)
