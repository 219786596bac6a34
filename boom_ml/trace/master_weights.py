"""16-bit parameters stepped through fp32 master copies (``master_weights=true``).

What Megatron-LM's ``Float16OptimizerWithFloat16Params`` (its ``--fp16`` training; ``--bf16``
adds fp32 gradient buffers, below), DeepSpeed's fp16 optimizer and apex's O2 level do: the
model's parameters and gradients are 16-bit; the optimizer holds an fp32 copy of every
trainable parameter and steps that copy with fp32 state. One step of it, as Megatron writes
it:

1. each 16-bit gradient is cast to an fp32 gradient of the master copy, and the 16-bit one is
   dropped (``_copy_model_grads_to_main_grads``: "Safe to deallocate model's grad");
2. fp16 only: the loss was scaled before backward, so the fp32 gradients are unscaled and
   checked for inf/NaN in one fused call (``_unscale_main_grads_and_check_for_nan``);
3. the inner optimizer steps the fp32 copies;
4. the copies are cast back into the 16-bit parameters (``_copy_main_params_to_model_params``,
   one multi-tensor kernel with apex: ``torch._foreach_copy_`` here, unless the optimizer
   runs its for-loop).

The fp32 copies are optimizer state (what ZeRO counts as 12 bytes per parameter with Adam's
two moments); their gradients live from the step until the next ``zero_grad``.

Not modelled: gradient accumulation into persistent fp32 buffers, which Megatron-LM turns on
for ``--bf16`` (``accumulate_allreduce_grads_in_fp32``: a ``main_grad`` of 4 bytes per
parameter alive all step, reduced in fp32) and DeepSpeed's bf16 optimizer keeps too; here the
gradients are 16-bit until the step, as in Megatron's ``--fp16`` default and apex O2.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class MasterWeights:
    """An optimizer over fp32 copies of 16-bit ``params``; ``make_inner`` builds the optimizer
    that steps the copies (the one the user named)."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        make_inner: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
        loss_scaling: bool,
        foreach: bool = True,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.masters = [
            torch.nn.Parameter(p.detach().float(), requires_grad=True) for p in self.params
        ]
        self.inner = make_inner(self.masters)
        self.loss_scaling = loss_scaling
        self.foreach = foreach  # the copy back as one multi-tensor kernel (else one per tensor)
        # the dynamic loss scale and the inf/NaN flag: one fp32 scalar each, on the device
        self.scale = torch.full((), 65536.0) if loss_scaling else None
        self.found_inf = torch.zeros(()) if loss_scaling else None
        self.method_notes = getattr(self.inner, "method_notes", [])

    @property
    def state(self) -> dict[torch.nn.Parameter, dict[str, Any]]:
        """The inner optimizer's state of each copy, and the copy itself, keyed by the model's
        parameter (what the tracer attributes to it)."""
        inner = self.inner.state
        return {
            p: {**inner.get(m, {}), "master": m}
            for p, m in zip(self.params, self.masters, strict=True)
        }

    @property
    def shared_state_keys(self) -> tuple[str, ...]:
        return getattr(self.inner, "shared_state_keys", ())

    def gradients(self) -> list[torch.Tensor]:
        """The fp32 copies' gradients alive now (from the last step until ``zero_grad``)."""
        return [m.grad for m in self.masters if m.grad is not None]

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.scale is not None else loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params + self.masters:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        for p, m in zip(self.params, self.masters, strict=True):
            if p.grad is not None:
                m.grad = p.grad.float()
                p.grad = None
        grads = self.gradients()
        if self.scale is not None and grads:
            self.found_inf.zero_()
            torch._amp_foreach_non_finite_check_and_unscale_(
                grads, self.found_inf, self.scale.reciprocal()
            )
        self.inner.step()
        if self.foreach:  # apex's multi_tensor_scale in Megatron: a few fused launches
            torch._foreach_copy_(self.params, self.masters)
        else:
            for p, m in zip(self.params, self.masters, strict=True):
                p.copy_(m)

    def host_tensors(self) -> list[torch.Tensor]:
        host = getattr(self.inner, "host_tensors", None)
        return host() if callable(host) else []

    def loose_tensors(self) -> list[torch.Tensor]:
        """Device tensors of this optimizer outside any parameter's state: the loss scale."""
        return [t for t in (self.scale, self.found_inf) if t is not None]
