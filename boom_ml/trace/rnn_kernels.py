"""The kernels of one cuDNN RNN call (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``), as kernel rows.

cuDNN's standard algorithm (``CUDNN_RNN_ALGO_STANDARD``, what PyTorch's ``cudnn/RNN.cpp:
get_algo`` picks unless the hidden size is small or a one-layer fp16 RNN qualifies for a
persistent kernel) runs, per layer and direction, one GEMM for the input projection of every
time step at once, then for each time step a GEMM of the previous hidden state with the
recurrent weights and one pointwise kernel for the gates. Backward runs the same recurrence
in reverse (pointwise gate gradients and a GEMM per step), then the input gradient and the
weight gradients as whole-sequence GEMMs. Each row here is one such kernel, in the kernel-row
convention of ``boom_ml.timing.per_op`` (``mm``: m rows, n the reduction, k the output
width), with ``repeat``: how many times it runs. Plain Python: the timing side reads it
without importing torch, the tracer counts FLOPs with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}
MODES = tuple(GATES)


@dataclass(frozen=True)
class RnnShape:
    """One RNN call: ``steps`` x ``batch`` inputs of width ``input_size``; ``proj`` is the
    LSTM projection size (0: none), ``out`` the width of each direction's output."""

    mode: str
    steps: int
    batch: int
    input_size: int
    hidden: int
    proj: int
    layers: int
    directions: int
    # CUDNN_LINEAR_INPUT (PyTorch's, always): the first layer projects its input with W_ih;
    # CUDNN_SKIP_INPUT (False) adds the input to the gates as it is (no input GEMMs)
    linear_input: bool = True

    @property
    def gates(self) -> int:
        return GATES[self.mode]

    @property
    def out(self) -> int:
        return self.proj or self.hidden

    def layer_input(self, layer: int) -> int:
        return self.input_size if layer == 0 else self.out * self.directions


def shape_of(mode: str, x: list[int], hx: list[int], cx: list[int], output: list[int]) -> RnnShape:
    """The call's shape from its tensors' shapes: time-major ``x`` (T, N, In), ``hx`` (L*D, N,
    out), ``cx`` (L*D, N, H; LSTM only, else empty) and ``output`` (T, N, D*out)."""
    steps, batch, input_size = x
    out = hx[-1]
    directions = max(output[-1] // max(out, 1), 1)
    hidden = cx[-1] if mode == "lstm" and len(cx) == 3 else out
    proj = out if hidden != out else 0
    return RnnShape(mode, steps, batch, input_size, hidden, proj, hx[0] // directions, directions)


# RNN.cpp, use_rnn_persist_small_h (cuDNN >= 8.2.1, compute capability >= 6): a call whose
# hidden size is at most this runs CUDNN_RNN_ALGO_PERSIST_STATIC_SMALL_H, (forward, backward)
PERSIST_SMALL_H = {"lstm": (192, 128), "gru": (192, 128), "rnn_tanh": (384, 256),
                   "rnn_relu": (384, 256)}  # fmt: skip


def persistent(shape: RnnShape, backward: bool, sm_major: int) -> bool:
    """Whether PyTorch's ``get_algo`` picks cuDNN's small-hidden persistent kernel for the
    call (an LSTM with projections always runs the standard algorithm)."""
    return (
        sm_major >= 6 and not shape.proj and shape.hidden <= PERSIST_SMALL_H[shape.mode][backward]
    )


def _mm(m: int, n: int, k: int, repeat: int) -> dict[str, Any]:
    return {"family": "gemm", "op": "mm", "b": 1, "m": m, "n": n, "k": k, "repeat": repeat}


def _pointwise(op: str, numel: int, repeat: int) -> dict[str, Any]:
    return {"family": "elementwise", "op": op, "numel": numel, "rows": 1, "cols": numel,
            "arity": 3, "transcendental": 1.0, "repeat": repeat}  # fmt: skip


def kernel_rows(shape: RnnShape, backward: bool) -> list[dict[str, Any]]:
    """The kernels of the forward (or backward) call, one row per distinct kernel."""
    s = shape
    g_h, rows_all = s.gates * s.hidden, s.steps * s.batch
    rows: list[dict[str, Any]] = []
    for layer in range(s.layers):
        width = s.layer_input(layer)
        projects = s.linear_input or layer > 0
        for _ in range(s.directions):
            if not backward:
                if projects:
                    rows.append(_mm(rows_all, width, g_h, 1))  # x_t W_ih for every t
                rows.append(_mm(s.batch, s.out, g_h, s.steps))  # h_{t-1} W_hh
                if s.proj:
                    rows.append(_mm(s.batch, s.hidden, s.proj, s.steps))  # h_t W_hr
                rows.append(_pointwise("sigmoid", s.batch * g_h, s.steps))
                continue
            rows.append(_pointwise("sigmoid_backward", s.batch * g_h, s.steps))
            rows.append(_mm(s.batch, g_h, s.out, s.steps))  # dh_{t-1} = dgates W_hh^T
            if s.proj:
                rows.append(_mm(s.batch, s.proj, s.hidden, s.steps))
            if projects:
                rows.append(_mm(rows_all, g_h, width, 1))  # dx = dgates W_ih^T
                rows.append(_mm(g_h, rows_all, width, 1))  # dW_ih = dgates^T x
            rows.append(_mm(g_h, rows_all, s.out, 1))  # dW_hh = dgates^T h
            if s.proj:
                rows.append(_mm(s.proj, rows_all, s.hidden, 1))
    return rows


def flops(shape: RnnShape, backward: bool) -> int:
    """The GEMM FLOPs of the call (2 m n k per GEMM; the pointwise kernels count none)."""
    return sum(
        2 * r["m"] * r["n"] * r["k"] * r["repeat"]
        for r in kernel_rows(shape, backward)
        if r["family"] == "gemm"
    )
