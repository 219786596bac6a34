"""Optimizers as a CUDA run would build them (foreach kernels, the CUDA default)."""

from __future__ import annotations

import torch

from boom_ml.specs import OPTIMIZERS, check_choice


def make_optimizer(name: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer | None:
    """Build ``name`` over ``params``; ``none`` means forward+backward only.

    ``foreach=True`` because PyTorch picks the foreach implementation by default when all
    parameters are on CUDA, and on CPU it would otherwise pick the per-tensor loop.
    """
    check_choice("optimizer", name, OPTIMIZERS)
    if name == "none":
        return None
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, foreach=True)
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=True)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3, foreach=True)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, foreach=True)
    if name == "adagrad":
        # Its "sum" state is created in the constructor (not lazily at the first step).
        return torch.optim.Adagrad(params, lr=1e-3, foreach=True)
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=1e-3, foreach=True)
    return torch.optim.Adafactor(params, lr=1e-2, foreach=True)
