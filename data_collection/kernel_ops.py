"""The kernel harness's op registry: for each op, how to build its inputs for one config.

A registry entry (``OpDef``) names the op's family (the op registry's family of the aten op
it launches, ``boom_ml.trace.ops``, so that measured rows and traced nodes agree), the sweep
parameters it takes, the ``Builder`` that turns (params, dtype, device) into a runnable
``Case``, and how params map onto the canonical kernel columns. ``data_collection.kernels`` runs and times them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from boom_ml.trace.ops import family_of

DTYPES = {
    "float32": torch.float32,
    "tf32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
Run = Callable[[], Any]
Builder = Callable[[dict[str, int], torch.dtype, torch.device], "Case"]


@dataclass(frozen=True)
class Case:
    """A built op: ``run()`` launches it; ``leaves`` get gradients in a backward row."""

    run: Run
    leaves: tuple[torch.Tensor, ...] = ()


@dataclass(frozen=True)
class OpDef:
    """How to build one op from a shape list, and which schema columns describe it."""

    family: str
    params: tuple[str, ...]  # names of the shape list's entries, in order
    build: Callable[[dict[str, int], torch.dtype, torch.device], Case]
    columns: Callable[[dict[str, int]], dict[str, int]]
    backward: bool = True
    tf32: bool = False  # TF32 changes its arithmetic (matmuls, convolutions)
    half_only_cuda: bool = False  # flash attention has no fp32 kernel on CUDA
    numel_params: tuple[str, ...] = ()  # capped at cap**2 in a dry run, not at cap
    row_op: str = ""  # the op its rows name, where another entry's op (default: its own key)


def _t(
    shape: Sequence[int], dtype: torch.dtype, dev: torch.device, grad: bool = True
) -> torch.Tensor:
    # Random data, never zeros: zeros can run faster than real data on tensor cores.
    return torch.randn(*shape, dtype=dtype, device=dev).requires_grad_(grad)


def _gemm(kind: str) -> Builder:
    # Canonical convention (NeuSight / DeepBench importers): (b, m, n) x (b, n, k); n reduces.
    def build(p: dict[str, int], dt: torch.dtype, dev: torch.device) -> Case:
        b, m, n, k = p.get("b", 1), p["m"], p["n"], p["k"]
        if kind == "mm":
            x, w = _t((m, n), dt, dev), _t((n, k), dt, dev)
            return Case(lambda: torch.mm(x, w), (x, w))
        if kind == "bmm":
            x, w = _t((b, m, n), dt, dev), _t((b, n, k), dt, dev)
            return Case(lambda: torch.bmm(x, w), (x, w))
        x, w, bias = _t((b * m, n), dt, dev), _t((k, n), dt, dev), _t((k,), dt, dev)
        return Case(lambda: F.linear(x, w, bias), (x, w, bias))

    return build


def _conv(p: dict[str, int], dt: torch.dtype, dev: torch.device) -> Case:
    groups = p.get("groups", 1)  # each output channel reads in_channels / groups inputs
    x = _t((p["batch"], p["in_channels"], p["input_h"], p["input_w"]), dt, dev)
    k = p["kernel_size"]
    w = _t((p["out_channels"], p["in_channels"] // groups, k, k), dt, dev)
    return Case(lambda: F.conv2d(x, w, None, p["stride"], p["padding"], 1, groups), (x, w))


def _sdpa(backend: str) -> Builder:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = SDPBackend.FLASH_ATTENTION if backend == "flash" else SDPBackend.MATH

    def build(p: dict[str, int], dt: torch.dtype, dev: torch.device) -> Case:
        shape = (p["batch"], p["heads"], p["seq"], p["head_dim"])
        q, k, v = (_t(shape, dt, dev) for _ in range(3))

        def run() -> torch.Tensor:
            # Pinning the backend makes "flash" fail loudly instead of silently falling back.
            with sdpa_kernel(chosen):
                return F.scaled_dot_product_attention(q, k, v, is_causal=bool(p["causal"]))

        return Case(run, (q, k, v))

    return build


def _norm(kind: str) -> Builder:
    def build(p: dict[str, int], dt: torch.dtype, dev: torch.device) -> Case:
        if kind == "batch_norm":
            x = _t((p["batch"], p["channels"], p["h"], p["w"]), dt, dev)
            c = p["channels"]
            w, b = _t((c,), dt, dev), _t((c,), dt, dev)
            mean = torch.zeros(c, dtype=dt, device=dev)
            var = torch.ones(c, dtype=dt, device=dev)
            return Case(lambda: F.batch_norm(x, mean, var, w, b, training=True), (x, w, b))
        x, w = _t((p["rows"], p["cols"]), dt, dev), _t((p["cols"],), dt, dev)
        if kind == "rms_norm":
            return Case(lambda: F.rms_norm(x, (p["cols"],), w), (x, w))
        if kind == "softmax":
            return Case(lambda: torch.softmax(x, dim=-1), (x,))
        if kind == "cross_entropy":
            target = torch.randint(0, p["cols"], (p["rows"],), device=dev)
            return Case(lambda: F.cross_entropy(x, target), (x,))
        b = _t((p["cols"],), dt, dev)
        return Case(lambda: F.layer_norm(x, (p["cols"],), w, b), (x, w, b))

    return build


# fmt: off
_UNARY: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
    "dropout": lambda x: F.dropout(x, 0.1, training=True),
}
# fmt: on


def _elementwise(kind: str) -> Builder:
    def build(p: dict[str, int], dt: torch.dtype, dev: torch.device) -> Case:
        x = _t((p["numel"],), dt, dev)
        if kind in ("add", "mul"):
            y = _t((p["numel"],), dt, dev)
            op = torch.add if kind == "add" else torch.mul
            return Case(lambda: op(x, y), (x, y))
        fn = _UNARY[kind]
        return Case(lambda: fn(x), (x,))

    return build


def _embedding(p: dict[str, int], dt: torch.dtype, dev: torch.device) -> Case:
    w = _t((p["num_embeddings"], p["dim"]), dt, dev)
    idx = torch.randint(0, p["num_embeddings"], (p["tokens"],), device=dev)
    return Case(lambda: F.embedding(idx, w), (w,))


def _optimizer(kind: str) -> Builder:
    def build(p: dict[str, int], dt: torch.dtype, dev: torch.device) -> Case:
        params = [
            torch.nn.Parameter(_t((p["numel"],), dt, dev, False)) for _ in range(p["tensors"])
        ]
        for q in params:
            q.grad = torch.randn_like(q)
        # foreach=True: the multi-tensor kernels PyTorch picks by default for CUDA params.
        if kind == "sgd":
            opt: torch.optim.Optimizer = torch.optim.SGD(
                params, lr=1e-3, momentum=0.9, foreach=True
            )
        else:
            cls = torch.optim.Adam if kind == "adam" else torch.optim.AdamW
            opt = cls(params, lr=1e-3, foreach=True)
        opt.step()  # create the state (exp_avg, momentum) so timed steps are steady-state
        return Case(opt.step)

    return build


def _copy(kind: str) -> Builder:
    def build(p: dict[str, int], dt: torch.dtype, dev: torch.device) -> Case:
        if kind == "transpose_copy":
            x = _t((p["rows"], p["cols"]), dt, dev, False)
            return Case(lambda: x.t().contiguous())
        x = _t((p["numel"],), dt, dev, False)
        if kind == "copy_":
            dst = torch.empty_like(x)
            return Case(lambda: dst.copy_(x))
        # Autocast's casts: fp32 master weights to half, half activations back to fp32.
        target = torch.bfloat16 if dt == torch.float32 else torch.float32
        return Case(lambda: x.to(target))

    return build


def _op(kernel: Any, params: str, build: Builder, cols: str = "", **kw: Any) -> OpDef:
    """An OpDef from space-separated names; ``cols`` maps schema columns to params.

    ``kernel`` is the aten op the case launches (its registry family labels the rows), or a
    family name for a case that launches several.

    ``"rows cols numel=rows*cols"``: a bare name copies the param of that name, ``a=x*y``
    multiplies params (or integer literals). Empty ``cols`` copies every param.
    """
    names = tuple(params.split())
    spec = [t.partition("=") for t in (cols or params).split()]
    mapping = {c: (expr or c).split("*") for c, _, expr in spec}

    def columns(p: dict[str, int]) -> dict[str, int]:
        return {
            c: math.prod(int(f) if f.isdigit() else p[f] for f in fs) for c, fs in mapping.items()
        }

    family = kernel if isinstance(kernel, str) else family_of(kernel)
    return OpDef(family, names, build, columns, **kw)


_ROWS = "rows cols numel=rows*cols"
_ATTN = "batch heads seq_q=seq seq_kv=seq head_dim"
_BN = "batch in_channels=channels input_h=h input_w=w rows=batch*h*w cols=channels numel=batch*channels*h*w"
_SDPA = "batch heads seq head_dim causal"
_CONV = "batch in_channels out_channels kernel_size input_h input_w stride padding"
_NUMEL = ("numel",)
aten = torch.ops.aten
# The aten op each elementwise case launches (dropout: the fused CUDA kernel).
_ELEMENTWISE_ATEN = {"add": aten.add, "mul": aten.mul, "relu": aten.relu, "gelu": aten.gelu,
                     "gelu_tanh": aten.gelu, "silu": aten.silu, "sigmoid": aten.sigmoid,
                     "tanh": aten.tanh, "dropout": aten.native_dropout}  # fmt: skip
# fmt: off
REGISTRY: dict[str, OpDef] = {
    "mm": _op(aten.mm, "m n k", _gemm("mm"), "b=1 m n k", tf32=True),
    "bmm": _op(aten.bmm, "b m n k", _gemm("bmm"), tf32=True),
    "linear": _op(aten.addmm, "b m n k", _gemm("linear"), tf32=True),
    "conv2d": _op(aten.convolution, _CONV, _conv, tf32=True),
    # depthwise (groups = in = out channels) and grouped convolutions: rows of op conv2d
    "conv2d_grouped": _op(aten.convolution, f"{_CONV} groups", _conv, tf32=True,
                          row_op="conv2d"),
    "sdpa_flash": _op(aten._scaled_dot_product_flash_attention, _SDPA, _sdpa("flash"), _ATTN,
                      half_only_cuda=True),
    # The math backend launches GEMMs and a softmax; its row stands for the attention call.
    "sdpa_math": _op("attention", _SDPA, _sdpa("math"), _ATTN, tf32=True),
    "layer_norm": _op(aten.native_layer_norm, "rows cols", _norm("layer_norm"), _ROWS),
    "rms_norm": _op(aten._fused_rms_norm, "rows cols", _norm("rms_norm"), _ROWS),
    "batch_norm": _op(aten.native_batch_norm, "batch channels h w", _norm("batch_norm"), _BN),
    "softmax": _op(aten._softmax, "rows cols", _norm("softmax"), _ROWS),
    # log_softmax + nll_loss in one row; the canonical schema has no "loss" family.
    "cross_entropy": _op("other", "rows cols", _norm("cross_entropy"), _ROWS),
    "embedding": _op(aten.embedding, "num_embeddings dim tokens", _embedding,
                     "rows=tokens cols=dim numel=tokens*dim"),
    **{n: _op(_ELEMENTWISE_ATEN[n], "numel", _elementwise(n), numel_params=_NUMEL)
       for n in ("add", "mul", *_UNARY)},
    **{n: _op(aten._foreach_add_, "tensors numel", _optimizer(n),
              "rows=tensors cols=numel numel=tensors*numel", backward=False, numel_params=_NUMEL)
       for n in ("sgd", "adam", "adamw")},
    "to_copy": _op(aten._to_copy, "numel", _copy("to_copy"), backward=False, numel_params=_NUMEL),
    "copy_": _op(aten.copy_, "numel", _copy("copy_"), backward=False, numel_params=_NUMEL),
    "transpose_copy": _op(aten.clone, "rows cols", _copy("transpose_copy"), _ROWS, backward=False),
}
# fmt: on
