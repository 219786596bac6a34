"""Route dropout to the kernel a CUDA run launches.

On CPU, ``F.dropout(x, p, training=True)`` takes ATen's generic path: it fills a float
noise tensor the size of ``x`` (``bernoulli_``), scales it and multiplies, and the
multiplication saves that noise for backward: 4 bytes per element, three kernels. On CUDA
the same call launches one fused ``native_dropout`` kernel that returns the output and a
bool mask, and backward reads the mask: 1 byte per element. A model with dropout after
every sublayer (T5, BERT, GPT-2 at their default 0.1) would otherwise be traced with
several activation-sized float tensors too many per layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

aten = torch.ops.aten


@contextlib.contextmanager
def cuda_dropout() -> Iterator[None]:
    """While active, ``F.dropout`` takes the fused path CUDA takes (``native_dropout``).

    CUDA fuses when training with 0 < p < 1 on a non-empty tensor, out of place; in-place
    dropout and the other cases keep ATen's generic path on CUDA too, so they are left
    alone. A module attribute swap, like ``attention.cuda_attention`` and for the same
    reason (checkpoint recomputation inside backward must trace the same way).
    """
    original = F.dropout

    def dropout(
        input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
    ) -> torch.Tensor:
        if training and 0.0 < p < 1.0 and not inplace and input.numel() > 0:
            return aten.native_dropout(input, p, True)[0]
        return original(input, p, training, inplace)

    F.dropout = dropout
    try:
        yield
    finally:
        F.dropout = original
