"""QLoRA's 4-bit NF4 base weights in bitsandbytes' layout, modelled for the fake-tensor trace.

bitsandbytes' ``Linear4bit`` cannot run on fake CPU tensors, so :class:`NF4Linear` holds
buffers of exactly the sizes ``bnb.functional.quantize_4bit`` allocates (bitsandbytes 0.50,
``blocksize=64``, ``quant_type="nf4"``, ``quant_storage=uint8``) and, in forward and
backward, launches stand-ins of the kernels bnb runs at training sizes (``trace/custom_ops``):

* the packed weight: ``(numel + 1) // 2`` uint8 (two 4-bit codes per byte)
* ``QuantState.code``: the 16-value NF4 table, fp32, one per layer
* without double quantisation: ``absmax``, one fp32 per 64 weights
* with it (``compress_statistics=True``, bnb's and QLoRA's default): ``absmax`` as one uint8
  per 64 weights, plus ``state2``: one fp32 absmax per 256 of those, its 256-value fp32
  code, and the fp32 ``offset`` (a 0-d tensor)

Forward (``MatMul4Bit`` at M > 1536 rows, bnb's ``_dequant_linear_fallback``): the nested
absmax is dequantised to fp32 and the offset added, the weight is dequantised to the compute
dtype into a transient buffer, then ``F.linear``. Backward: no weight gradient (frozen), the
weight is dequantised again and ``grad_output @ W`` gives the input gradient. Nothing but the
packed weight and its state is saved for backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import boom_ml.trace.custom_ops  # noqa: F401 - defines torch.ops.boom.*

BLOCKSIZE = 64  # bnb's default for 4-bit weights (and QLoRA's)
NESTED_BLOCKSIZE = 256  # the second-level blocks of double quantisation (fixed in bnb)
NF4_CODE_VALUES = 16
NESTED_CODE_VALUES = 256


def _blocks(n: int, size: int) -> int:
    return -(n // -size)


def nf4_buffer_shapes(
    rows: int, cols: int, double_quant: bool = True
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every tensor bnb keeps for one 4-bit ``rows x cols`` weight."""
    n = rows * cols
    blocks = _blocks(n, BLOCKSIZE)
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
        "packed": (((n + 1) // 2, 1), torch.uint8),
        "code": ((NF4_CODE_VALUES,), torch.float32),
    }
    if double_quant:
        shapes["absmax"] = ((blocks,), torch.uint8)
        shapes["absmax2"] = ((_blocks(blocks, NESTED_BLOCKSIZE),), torch.float32)
        shapes["absmax_code"] = ((NESTED_CODE_VALUES,), torch.float32)
        shapes["absmax_offset"] = ((), torch.float32)
    else:
        shapes["absmax"] = ((blocks,), torch.float32)
    return shapes


def nf4_bytes(rows: int, cols: int, double_quant: bool = True) -> int:
    """Bytes of one 4-bit weight and its quantisation state (bnb's exact tensor sizes)."""
    total = 0
    for shape, dtype in nf4_buffer_shapes(rows, cols, double_quant).values():
        total += int(torch.Size(shape).numel()) * dtype.itemsize
    return total


class _Dequantized(torch.autograd.Function):
    """``F.linear`` with a weight dequantised in forward and again in backward (bnb's MatMul4Bit)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: NF4Linear) -> torch.Tensor:  # type: ignore[override]
        ctx.layer = layer
        return F.linear(x, layer.dequantize(x.dtype), layer.bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        weight = ctx.layer.dequantize(grad.dtype)
        return torch.matmul(grad, weight), None


class NF4Linear(nn.Module):
    """A frozen ``nn.Linear`` stored as bitsandbytes' NF4 (see the module docstring)."""

    def __init__(
        self,
        linear: nn.Module,  # nn.Linear, or transformers' Conv1D
        compute_dtype: torch.dtype,
        double_quant: bool = True,
        clone_output: bool = False,
    ) -> None:
        super().__init__()
        if isinstance(linear, nn.Linear):
            self.in_features, self.out_features = linear.in_features, linear.out_features
        else:  # transformers' Conv1D (GPT-2): x @ W with W (in, out), quantised transposed
            self.in_features, self.out_features = linear.weight.shape
        self.compute_dtype = compute_dtype
        self.double_quant = double_quant
        # peft's lora.bnb.Linear4bit clones the base layer's output ("defensively", per its
        # comment); a LoRA-wrapped 4-bit layer therefore writes its output twice.
        self.clone_output = clone_output
        device = linear.weight.device
        for name, (shape, dtype) in nf4_buffer_shapes(
            self.out_features, self.in_features, double_quant
        ).items():
            self.register_buffer(name, torch.empty(shape, dtype=dtype, device=device))
        self.bias = None
        if linear.bias is not None:
            self.bias = nn.Parameter(linear.bias.detach().to(compute_dtype), requires_grad=False)

    @property
    def logical_numel(self) -> int:
        """Weights this layer stands for (what peft counts for a Params4bit: 2 per byte)."""
        return self.in_features * self.out_features

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        absmax = self.absmax
        if self.double_quant:
            absmax = torch.ops.boom.dequantize_blockwise(absmax, self.absmax2, self.absmax_code)
            absmax = absmax + self.absmax_offset
        return torch.ops.boom.dequantize_nf4(
            self.packed, absmax, self.code, self.out_features, self.in_features, dtype
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inp_dtype = x.dtype
        out = _Dequantized.apply(x.to(self.compute_dtype), self)
        out = out.to(inp_dtype)
        return out.clone() if self.clone_output else out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, nf4, "
            f"double_quant={self.double_quant}, compute_dtype={self.compute_dtype}"
        )
