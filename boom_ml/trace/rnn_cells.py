"""``nn.LSTMCell`` / ``nn.GRUCell`` traced as the kernels a CUDA run launches.

On CPU a cell step is a dozen ops (two ``addmm``, a chunk, sigmoids, tanh, products, sums)
and twice as many in backward. On CUDA, ``LSTMCell`` and ``GRUCell``
(``aten/src/ATen/native/RNN.cpp``) multiply the input and the hidden state by their weights
(two ``mm``) and run one fused pointwise kernel, ``_thnn_fused_lstm_cell`` or
``_thnn_fused_gru_cell``, which adds the biases, applies the gates and keeps a workspace
(the gates: 4 and 5 hidden widths per sample) for its fused backward kernel. The fused ops'
meta kernels cannot run here (the LSTM one rejects a cell without biases, the GRU one has
none), so ``boom::fused_{lstm,gru}_cell`` and their backward ops stand for them: the same
outputs, workspace and gradients (aten's backward returns one gate gradient for both the
input and the hidden gates; the bias gradients are sums of the gate gradients over the
batch, reduction kernels of their own: one for the LSTM's two biases, two for the GRU's; a
missing output gradient is read as zero, never materialised). Under autocast the GEMMs
cast the weights (cached for the autocast region, as CUDA's cast of ``lstm_cell``/``gru_cell``
arguments is) and the state; the biases are read as they are (a cached cast of a few KiB).
``RNNCell`` (tanh or ReLU) has no fused kernel on CUDA: its CPU ops are CUDA's.
``rnn.cuda_rnn`` swaps :data:`CELL_SWAPS` into ``torch._VF`` with the layers' functions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from boom_ml.trace.ops import register

LSTM_GATES, GRU_GATES, GRU_WORKSPACE = 4, 3, 5  # hidden widths: gates, GRU's workspace


def _fused_lstm_cell(
    igates: Tensor, hgates: Tensor, cx: Tensor, b_ih: Tensor | None, b_hh: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    return igates.new_empty(cx.shape), igates.new_empty(cx.shape), igates.new_empty(igates.shape)


def _fused_lstm_cell_backward(
    grad_hy: Tensor | None, grad_cy: Tensor | None, cx: Tensor, cy: Tensor, workspace: Tensor
) -> tuple[Tensor, Tensor]:
    return workspace.new_empty(workspace.shape), cx.new_empty(cx.shape)


def _fused_gru_cell(
    igates: Tensor, hgates: Tensor, hx: Tensor, b_ih: Tensor | None, b_hh: Tensor | None
) -> tuple[Tensor, Tensor]:
    return igates.new_empty(hx.shape), igates.new_empty((hx.shape[0], GRU_WORKSPACE * hx.shape[1]))


def _fused_gru_cell_backward(grad_hy: Tensor, workspace: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    batch, hidden = grad_hy.shape
    gates = GRU_GATES * hidden
    return (grad_hy.new_empty((batch, gates)), grad_hy.new_empty((batch, gates)),
            grad_hy.new_empty(grad_hy.shape))  # fmt: skip


def _op(name: str, fake):  # noqa: ANN001, ANN202
    """``boom::<name>``: a trace runs fake tensors only, so the op and its fake are one."""
    op = torch.library.custom_op(f"boom::{name}", mutates_args=())(fake)
    op.register_fake(fake)
    return op


fused_lstm_cell = _op("fused_lstm_cell", _fused_lstm_cell)
fused_lstm_cell_backward = _op("fused_lstm_cell_backward", _fused_lstm_cell_backward)
fused_gru_cell = _op("fused_gru_cell", _fused_gru_cell)
fused_gru_cell_backward = _op("fused_gru_cell_backward", _fused_gru_cell_backward)


def _lstm_context(ctx, inputs, output) -> None:  # noqa: ANN001
    ctx.set_materialize_grads(False)  # no zero gradient for the unused workspace output
    ctx.has_bias = inputs[3] is not None
    ctx.save_for_backward(inputs[2], output[1], output[2])


def _lstm_grad(ctx, grad_hy, grad_cy, _grad_workspace):  # noqa: ANN001
    if grad_hy is None and grad_cy is None:  # RNN.cu: nothing to propagate, no kernel
        return None, None, None, None, None
    cx, cy, workspace = ctx.saved_tensors
    # a missing gradient is read as zero by the kernel, never materialised
    gates, grad_cx = fused_lstm_cell_backward(grad_hy, grad_cy, cx, cy, workspace)
    # RNN.cu sums the gate gradients over the batch for the biases: a reduction kernel
    bias = gates.sum(0) if ctx.has_bias else None
    return gates, gates, grad_cx, bias, bias


def _gru_context(ctx, inputs, output) -> None:  # noqa: ANN001
    ctx.set_materialize_grads(False)
    ctx.has_bias = inputs[3] is not None
    ctx.save_for_backward(output[1])


def _gru_grad(ctx, grad_hy, _grad_workspace):  # noqa: ANN001
    if grad_hy is None:
        return None, None, None, None, None
    (workspace,) = ctx.saved_tensors
    gi, gh, grad_hx = fused_gru_cell_backward(grad_hy, workspace)
    if not ctx.has_bias:
        return gi, gh, grad_hx, None, None
    return gi, gh, grad_hx, gi.sum(0), gh.sum(0)  # RNN.cu: one reduction per bias


fused_lstm_cell.register_autograd(_lstm_grad, setup_context=_lstm_context)
fused_gru_cell.register_autograd(_gru_grad, setup_context=_gru_context)

# one pointwise kernel each: no GEMM FLOPs, every input read and output written once
register("boom.fused_lstm_cell boom.fused_lstm_cell_backward boom.fused_gru_cell "
         "boom.fused_gru_cell_backward", "elementwise")(lambda *a, **k: 0)  # fmt: skip


def _lstm_cell(x: Tensor, hx: tuple[Tensor, Tensor], w_ih: Tensor, w_hh: Tensor,
               b_ih: Tensor | None = None, b_hh: Tensor | None = None) -> tuple[Tensor, Tensor]:  # fmt: skip
    # F.linear without a bias is CUDA's matmul by the transposed weight; under autocast it
    # casts the weights once per autocast region (cached, as the cell's own cast is)
    igates, hgates = F.linear(x, w_ih), F.linear(hx[0], w_hh)
    cx = hx[1].to(igates.dtype)  # autocast casts the cell state too (none without autocast)
    with torch.autocast("cpu", enabled=False):
        hy, cy, _ = fused_lstm_cell(igates, hgates, cx, b_ih, b_hh)
    return hy, cy


def _gru_cell(x: Tensor, hx: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor | None = None,
              b_hh: Tensor | None = None) -> Tensor:  # fmt: skip
    igates, hgates = F.linear(x, w_ih), F.linear(hx, w_hh)
    with torch.autocast("cpu", enabled=False):
        hy, _ = fused_gru_cell(igates, hgates, hx.to(igates.dtype), b_ih, b_hh)
    return hy


# the torch._VF functions nn.LSTMCell / nn.GRUCell call, as a CUDA run executes them
# (swapped in by ``rnn.cuda_rnn`` with the whole layers')
CELL_SWAPS = {"lstm_cell": _lstm_cell, "gru_cell": _gru_cell}
