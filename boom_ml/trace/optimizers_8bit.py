"""Optimizers PyTorch does not ship, with the state and kernels of the libraries people use.

``AdamW8bit`` is bitsandbytes' ``AdamW8bit`` / ``PagedAdamW8bit`` (0.50, ``Optimizer2State``
with ``optim_bits=8``, ``block_wise=True``), modelled analytically because its CUDA kernels
cannot run on fake tensors. Its state is exactly what ``init_state`` allocates:

* a parameter of at least ``min_8bit_size`` (4096) elements: ``state1`` and ``state2`` as
  uint8 of the parameter's shape, and ``absmax1`` / ``absmax2``, one fp32 per block of 256;
* a smaller one: ``state1`` and ``state2`` in fp32;
* ``qmap1`` / ``qmap2``: the signed and unsigned 256-value dynamic maps (fp32), one pair for
  the whole optimizer;
* paged: ``state1`` / ``state2`` of parameters with at least 1e5 elements come from
  ``get_paged`` (CUDA unified memory, paged out to the host under pressure): they are
  reported as host memory, like Adam's step counters; absmax and small states stay on the GPU.

Each step launches one kernel per parameter (``optimizer_update_8bit_blockwise``: dequantise
both states, update, requantise, write the parameter), traced as one ``boom::`` op with the
same reads and in-place writes (``trace/custom_ops``).

``Lion`` (Chen et al. 2023, as lucidrains' lion-pytorch writes it): one momentum buffer in the
parameter's dtype; the update is elementwise torch ops, foreach or per tensor.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

import boom_ml.trace.custom_ops  # noqa: F401 - defines torch.ops.boom.*

MIN_8BIT_SIZE = 4096  # bitsandbytes' default: smaller tensors keep fp32 state
BLOCKSIZE = 256  # bitsandbytes' blockwise optimizer blocks
PAGED_MIN_NUMEL = 100_000  # get_state_buffer pages only tensors of at least 1e5 elements
QMAP_VALUES = 256


def adam8bit_state_bytes(numel: int) -> int:
    """Device bytes of one parameter's 8-bit Adam state (without the shared qmaps)."""
    if numel < MIN_8BIT_SIZE:
        return 2 * 4 * numel
    blocks = -(numel // -BLOCKSIZE)
    return 2 * numel + 2 * 4 * blocks


class AdamW8bit(torch.optim.Optimizer):
    """bitsandbytes' blockwise 8-bit AdamW (``paged=True``: PagedAdamW8bit)."""

    shared_state_keys = ("qmap1", "qmap2")  # one pair for all parameters

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        paged: bool = False,
    ) -> None:
        super().__init__(
            params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        )
        self.paged = paged
        self.qmaps: tuple[torch.Tensor, torch.Tensor] | None = None
        name = "paged-adamw8bit" if paged else "adamw8bit"
        paging = ""
        if paged:
            # a frozen parameter (LoRA's base weights) gets no gradient, so no state to page
            params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
            big = sum(p.numel() >= PAGED_MIN_NUMEL for p in params)
            paging = (
                f", paged state on the host ({big} of {len(params)} trainable parameters:"
                f" those of {PAGED_MIN_NUMEL:,} elements or more)"
                if big
                else f", nothing paged (bitsandbytes pages the state of parameters of"
                f" {PAGED_MIN_NUMEL:,} elements or more; no trainable one here)"
            )
        self.method_notes = [f"{name}: bitsandbytes 8-bit state and kernel analytic" + paging]

    def _init_state(self, p: torch.nn.Parameter) -> dict:
        state = self.state[p]
        state["step"] = 0  # a Python int, as in bitsandbytes: no tensor, no kernel
        if p.numel() < MIN_8BIT_SIZE:
            state["state1"] = torch.zeros_like(p, dtype=torch.float32)
            state["state2"] = torch.zeros_like(p, dtype=torch.float32)
            return state
        if self.qmaps is None:
            self.qmaps = (torch.zeros(QMAP_VALUES), torch.zeros(QMAP_VALUES))
        blocks = -(p.numel() // -BLOCKSIZE)
        state["state1"] = torch.zeros_like(p, dtype=torch.uint8)
        state["qmap1"] = self.qmaps[0]
        state["state2"] = torch.zeros_like(p, dtype=torch.uint8)
        state["qmap2"] = self.qmaps[1]
        state["absmax1"] = torch.zeros(blocks, dtype=torch.float32)
        state["absmax2"] = torch.zeros(blocks, dtype=torch.float32)
        return state

    def host_tensors(self) -> list[torch.Tensor]:
        """Paged state buffers: unified memory on the host, not in PyTorch's device pool."""
        if not self.paged:
            return []
        return [
            s[key]
            for p, s in self.state.items()
            if p.numel() >= PAGED_MIN_NUMEL
            for key in ("state1", "state2")
            if key in s
        ]

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p] or self._init_state(p)
                state["step"] += 1
                if state["state1"].dtype == torch.float32:
                    torch.ops.boom.optimizer_update_32bit_(
                        p, p.grad, state["state1"], state["state2"]
                    )
                    continue
                torch.ops.boom.optimizer_update_8bit_blockwise_(
                    p, p.grad, state["state1"], state["state2"], state["absmax1"],
                    state["absmax2"], state["qmap1"], state["qmap2"],
                )  # fmt: skip


class Lion(torch.optim.Optimizer):
    """Lion: sign of an interpolated momentum; one momentum buffer per parameter."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        foreach: bool = True,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})
        self.foreach = foreach

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                if not self.state[p]:
                    self.state[p]["exp_avg"] = torch.zeros_like(p)
            grads = [p.grad for p in params]
            avgs = [self.state[p]["exp_avg"] for p in params]
            lr, wd = group["lr"], group["weight_decay"]
            beta1, beta2 = group["betas"]
            if self.foreach:
                if wd:
                    torch._foreach_mul_(params, 1 - lr * wd)
                updates = torch._foreach_lerp(avgs, grads, 1 - beta1)
                torch._foreach_sign_(updates)
                torch._foreach_add_(params, updates, alpha=-lr)
                del updates
                torch._foreach_lerp_(avgs, grads, 1 - beta2)
                continue
            for p, g, m in zip(params, grads, avgs, strict=True):
                if wd:
                    p.mul_(1 - lr * wd)
                update = m.lerp(g, 1 - beta1).sign_()
                p.add_(update, alpha=-lr)
                del update
                m.lerp_(g, 1 - beta2)
