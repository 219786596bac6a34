"""``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` traced as the cuDNN calls a CUDA run makes.

On CPU, PyTorch runs an LSTM through oneDNN (``mkldnn_rnn_layer``, whose time and memory say
nothing of a GPU) and a GRU or plain RNN as a Python-level loop of cell ops (hundreds of
thousands of nodes for a long sequence). A CUDA run calls ``_cudnn_rnn`` once per module call
and ``_cudnn_rnn_backward`` once in backward (``aten/src/ATen/native/cudnn/RNN.cpp``). While
:func:`cuda_rnn` is active, the modules' ``_VF`` functions are replaced by ``boom::cudnn_*``
ops that stand for those two calls: the same outputs (a time-major output, the final hidden
and cell states, and the training reserve that stays alive until backward), and in backward
the input, state and weight gradients. ``batch_first`` inputs are transposed and copied to
time-major first, as ``_cudnn_rnn`` does. Under autocast, inputs and weights are cast to the
autocast dtype as ``cudnn/AutocastRNN.cpp`` does. The time of each call is that of the kernels
:mod:`boom_ml.trace.rnn_kernels` lists.

The reserve's size is not documented by cuDNN (``cudnnGetRNNTrainingReserveSize``); it is
estimated from what backward must read (``rnn_reserve.csv``, a versioned table with its basis).
Packed sequences (``pack_padded_sequence``) keep PyTorch's CPU path: their batch sizes per
step are data, which fake tensors do not hold. Dropout between layers is not modelled.
"""

from __future__ import annotations

import contextlib
import csv
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

from boom_ml.trace import rnn_kernels
from boom_ml.trace.ops import register
from boom_ml.trace.rnn_cells import CELL_SWAPS

RESERVE_TABLE = Path(__file__).with_name("rnn_reserve.csv")


@cache
def reserve_units() -> dict[str, tuple[int, int, int]]:
    """mode -> (gate, cell, output) units the reserve keeps per layer, direction, step and
    sample: times the hidden size, the hidden size, and the output width."""
    with RESERVE_TABLE.open() as f:
        rows = [r for r in csv.DictReader(line for line in f if not line.startswith("#"))]
    return {r["mode"]: (int(r["gate_units"]), int(r["cell_units"]), int(r["output_units"]))
            for r in rows}  # fmt: skip


def reserve_elements(shape: rnn_kernels.RnnShape) -> int:
    gates, cell, output = reserve_units()[shape.mode]
    per_step = gates * shape.hidden + cell * shape.hidden + output * shape.out
    return shape.layers * shape.directions * shape.steps * shape.batch * per_step


def _forward_fake(mode: str):
    def fake(x: Tensor, hx: Tensor, cx: Tensor, weights: list[Tensor], hidden: int, proj: int,
             layers: int, directions: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
        out = proj or hidden
        output = x.new_empty((x.shape[0], x.shape[1], out * directions))
        hy = hx.new_empty(hx.shape)
        cy = cx.new_empty(cx.shape)
        shape = rnn_kernels.shape_of(mode, list(x.shape), list(hx.shape), list(cx.shape),
                                     list(output.shape))  # fmt: skip
        reserve = x.new_empty((reserve_elements(shape),))
        return output, hy, cy, reserve

    return fake


def _backward_fake(x: Tensor, hx: Tensor, cx: Tensor, output: Tensor, grad_output: Tensor,
                   grad_hy: Tensor, grad_cy: Tensor, reserve: Tensor,
                   weights: list[Tensor]) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:  # fmt: skip
    return (x.new_empty(x.shape), hx.new_empty(hx.shape), cx.new_empty(cx.shape),
            [w.new_empty(w.shape) for w in weights])  # fmt: skip


def _define(mode: str):
    """``boom::cudnn_<mode>`` and its backward op, with autograd between them."""
    fake = _forward_fake(mode)  # fake tensors are all a trace runs: the same for both
    forward = torch.library.custom_op(f"boom::cudnn_{mode}", mutates_args=())(fake)
    forward.register_fake(fake)
    backward = torch.library.custom_op(f"boom::cudnn_{mode}_backward", mutates_args=())(
        _backward_fake
    )
    backward.register_fake(_backward_fake)

    def setup_context(ctx, inputs, output) -> None:  # noqa: ANN001
        x, hx, cx, weights = inputs[:4]
        ctx.save_for_backward(x, hx, cx, output[0], output[3], *weights)

    def grad(ctx, grad_output, grad_hy, grad_cy, _grad_reserve):  # noqa: ANN001
        x, hx, cx, out, reserve, *weights = ctx.saved_tensors
        # _cudnn_rnn_backward zero-fills the gradients of unused outputs
        grads = [g if g is not None else torch.zeros_like(t)
                 for g, t in ((grad_output, out), (grad_hy, hx), (grad_cy, cx))]  # fmt: skip
        dx, dhx, dcx, dweights = backward(x, hx, cx, out, *grads, reserve, weights)
        return dx, dhx, dcx, dweights, None, None, None, None

    forward.register_autograd(grad, setup_context=setup_context)
    return forward


_OPS = {mode: _define(mode) for mode in rnn_kernels.MODES}


def _flop_formula(mode: str, backward: bool):
    """The call's GEMM FLOPs from its tensors' shapes (backward's inputs start x, hx, cx,
    output; forward's output comes first among its results)."""

    def formula(x, hx, cx, *rest, out_shape=None, **kw) -> int:  # noqa: ANN001
        output = rest[0] if backward else out_shape[0]
        shape = rnn_kernels.shape_of(mode, list(x), list(hx), list(cx), list(output))
        return rnn_kernels.flops(shape, backward)

    return formula


for _mode in rnn_kernels.MODES:
    # family gemm: their time is GEMMs' (timing/per_op expands them into kernel rows)
    register(f"boom.cudnn_{_mode}", "gemm")(_flop_formula(_mode, backward=False))
    register(f"boom.cudnn_{_mode}_backward", "gemm")(_flop_formula(_mode, backward=True))


def _call(mode: str, x: Tensor, hx: Tensor, cx: Tensor | None, params: list[Tensor],
          num_layers: int, bidirectional: bool,
          batch_first: bool) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    directions = 2 if bidirectional else 1
    # each layer and direction holds w_ih, w_hh, (b_ih, b_hh,) and for a projected LSTM w_hr
    per = len(params) // (num_layers * directions)
    hidden = params[0].shape[0] // rnn_kernels.GATES[mode]
    proj = params[per - 1].shape[0] if per in (3, 5) else 0
    if torch.is_autocast_enabled("cpu"):  # autocast_policy makes CPU autocast CUDA's
        dtype = torch.get_autocast_dtype("cpu")
        x, hx = x.to(dtype), hx.to(dtype)
        cx = cx.to(dtype) if cx is not None else None
        params = [p.to(dtype) for p in params]
    if batch_first:
        x = x.transpose(0, 1)
    x = x.contiguous()
    cell = cx if cx is not None else x.new_empty((0,))
    with torch.autocast("cpu", enabled=False):
        output, hy, cy, _ = _OPS[mode](x, hx, cell, params, hidden, proj, num_layers, directions)
    return (output.transpose(0, 1) if batch_first else output), hy, cy


def _lstm(original):
    def lstm(*args):  # noqa: ANN002
        if isinstance(args[1], Tensor):  # (data, batch_sizes, ...): a packed sequence
            return original(*args)
        x, (hx, cx), params, _bias, num_layers, _dropout, _train, bidir, batch_first = args
        return _call("lstm", x, hx, cx, list(params), num_layers, bidir, batch_first)

    return lstm


def _single_state(mode: str, original):
    def rnn(*args):  # noqa: ANN002
        if isinstance(args[2], Tensor):  # (data, batch_sizes, hx, ...): a packed sequence
            return original(*args)
        x, hx, params, _bias, num_layers, _dropout, _train, bidir, batch_first = args
        output, hy, _ = _call(mode, x, hx, None, list(params), num_layers, bidir, batch_first)
        return output, hy

    return rnn


@contextlib.contextmanager
def cuda_rnn() -> Iterator[None]:
    """While active, ``nn.LSTM``/``nn.GRU``/``nn.RNN`` run as cuDNN does (module docstring),
    and ``nn.LSTMCell``/``nn.GRUCell`` as CUDA does (``rnn_cells``).

    A swap of ``torch._VF``'s attributes (the functions the modules call), not a dispatch
    mode: for the same reason as ``attention.cuda_attention``, checkpoint recomputation
    inside backward must take the same path as the forward.
    """
    vf, native = torch._VF, torch._C._VariableFunctions
    swaps = {"lstm": _lstm(native.lstm)}
    swaps.update({m: _single_state(m, getattr(native, m)) for m in ("gru", "rnn_tanh", "rnn_relu")})
    swaps.update(CELL_SWAPS)  # nn.LSTMCell / nn.GRUCell: two GEMMs and a fused kernel a step
    saved = {name: vf.__dict__.get(name) for name in swaps}  # torch._VF resolves the rest lazily
    try:
        for name, fn in swaps.items():
            setattr(vf, name, fn)
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                vf.__dict__.pop(name, None)
            else:
                setattr(vf, name, value)
