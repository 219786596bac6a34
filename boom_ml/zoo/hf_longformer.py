"""Longformer and LED encoders on fake tensors: no token has global attention.

Their encoders ask ``is_index_global_attn.flatten().any().item()`` whether any token of the
batch attends globally, a value a fake tensor does not have. The zoo's inputs give no
``global_attention_mask`` (masked-LM and seq2seq training attend locally everywhere), so
the answer is False, the sliding-window path a GPU takes for them; the patched encoder
answers that ``.item()`` (the only one on a boolean in these forwards) with False.

Patched per instance, on meta builds only: a model built on a real device keeps the check.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

# encoders whose forward reads "any global attention?" off the device
ENCODERS = ("LongformerEncoder", "LEDEncoder")


class _NoGlobalAttention(TorchDispatchMode):
    """``bool_tensor.item()`` is False: no token of the batch has global attention."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func is torch.ops.aten._local_scalar_dense.default and args[0].dtype == torch.bool:
            return False
        return func(*args, **(kwargs or {}))


def _local_only_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The class's own forward, with "any global attention?" answered False."""
    with _NoGlobalAttention():
        return type(self).forward(self, *args, **kwargs)


def patch_local_attention(model: nn.Module) -> int:
    """Patch every Longformer / LED encoder of ``model`` (see the module docstring)."""
    patched = 0
    for module in model.modules():
        if type(module).__name__ in ENCODERS:
            module.forward = types.MethodType(_local_only_forward, module)
            patched += 1
    return patched
