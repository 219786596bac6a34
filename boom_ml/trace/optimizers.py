"""Optimizers as a CUDA run would build them (the implementation PyTorch picks there)."""

from __future__ import annotations

from typing import Any

import torch

from boom_ml.specs import OPTIMIZERS, check_choice
from boom_ml.stack import resolve_optimizer_impl, resolve_stack
from boom_ml.trace.master_weights import MasterWeights
from boom_ml.trace.optimizers_8bit import AdamW8bit, Lion


def make_optimizer(
    name: str,
    params: list[torch.nn.Parameter],
    impl: str = "auto",
    master_weights: bool = False,
    loss_scaling: bool = False,
) -> Any:
    """Build ``name`` over ``params``; ``none`` means forward+backward only.

    ``impl`` (foreach | fused | loop) is passed explicitly: on CPU tensors PyTorch would
    pick the per-tensor loop, where on CUDA it picks foreach for most optimizers (and the
    loop for Adafactor). ``auto`` resolves to what the installed release does on CUDA.
    ``master_weights``: ``name`` steps fp32 copies of the (16-bit) parameters
    (:class:`~boom_ml.trace.master_weights.MasterWeights`; ``loss_scaling`` for fp16).
    """
    check_choice("optimizer", name, OPTIMIZERS)
    if name == "none":
        return None
    if master_weights:
        impl = resolve_optimizer_impl(name, impl, resolve_stack()) if impl == "auto" else impl
        inner = lambda copies: make_optimizer(name, copies, impl)  # noqa: E731
        return MasterWeights(params, inner, loss_scaling, foreach=impl != "loop")
    impl = resolve_optimizer_impl(name, impl, resolve_stack()) if impl == "auto" else impl
    flags = {"foreach": impl == "foreach"}
    if impl == "fused":
        flags = {"fused": True}
    if name in ("adamw8bit", "paged-adamw8bit"):  # bitsandbytes: one kernel per tensor
        return AdamW8bit(params, lr=1e-3, paged=name == "paged-adamw8bit")
    if name == "lion":
        return Lion(params, lr=1e-4, foreach=impl != "loop")
    if name == "adamw-fused":  # the name forces torch's fused kernel
        return torch.optim.AdamW(params, lr=1e-3, fused=True)
    if name == "sgd-nesterov":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, nesterov=True, **flags)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, **flags)
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, **flags)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3, **flags)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, **flags)
    if name == "adagrad":
        # Its "sum" state is created in the constructor (not lazily at the first step).
        return torch.optim.Adagrad(params, lr=1e-3, **flags)
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=1e-3, **flags)
    return torch.optim.Adafactor(params, lr=1e-2, **flags)
