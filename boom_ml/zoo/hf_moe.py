"""Mixture-of-experts layers on fake tensors: every expert gets a known share of the tokens.

A router's top-k choice depends on values that fake and meta tensors do not have, and the
transformers expert loops ask ``nonzero()`` / ``torch.where`` which experts were hit and with
which tokens: data-dependent shapes a fake tensor cannot answer. A trained router spreads
tokens roughly evenly (load-balancing loss), so the trace routes them evenly and
deterministically: of the ``tokens * top_k`` token-expert pairs, each of the ``E`` experts
gets ``tokens * top_k / E`` (the first ``pairs % E`` experts one more). ``moe_imbalance``
(>= 1) multiplies the busiest expert's share; the others split what is left evenly. A
per-expert capacity from the config (Switch Transformer's ``expert_capacity``, per sequence
as transformers applies it) caps every share; tokens over it are dropped, as on a GPU.

The router still runs (its linear, softmax and top-k are real kernels and its logits feed
the auxiliary losses); only which tokens go where is decided here. Experts with 3-D weights
(Mixtral, Qwen-MoE, DeepSeek, OLMoE, ...) then run transformers' default grouped_mm path as
batched GEMMs; Switch Transformer's separate expert modules and DBRX's stacked expert
weights run their eager loops (gather the expert's tokens, its MLP, scale, ``index_add_``
back).

Patched per instance (``patch_moe``), so nothing global changes and a model built on a real
device for a measurement keeps transformers' own routing.
"""

from __future__ import annotations

import math
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from boom_ml.errors import InvalidInputError

DEFAULT_IMBALANCE = 1.0


def expert_loads(
    pairs: int, experts: int, cap: int, imbalance: float = DEFAULT_IMBALANCE
) -> list[int]:
    """Tokens each expert processes: ``pairs`` token-expert assignments spread over ``experts``.

    Expert 0 is the busiest: ``imbalance`` times the even share (``pairs / experts``); the
    rest share the remainder evenly. No expert takes more than ``cap`` tokens (one token
    picks an expert at most once, and capacity limits drop the overflow).
    """
    if not math.isfinite(imbalance) or imbalance < 1.0:
        raise InvalidInputError(
            f"moe_imbalance must be a finite number >= 1.0 (1.0 = even routing), got {imbalance}"
        )
    if experts <= 0 or pairs <= 0:
        return [0] * max(experts, 0)

    def spread(total: int, n: int) -> list[int]:
        return [total // n + (1 if i < total % n else 0) for i in range(n)]

    if imbalance == 1.0 or experts == 1:
        loads = spread(pairs, experts)
    else:
        busiest = min(pairs, round(imbalance * pairs / experts))
        loads = [busiest, *spread(pairs - busiest, experts - 1)]
    return [min(n, cap) for n in loads]


def topk_loads(tokens: int, top_k: int, experts: int, imbalance: float) -> list[int]:
    """:func:`expert_loads` of top-k routing, where every token-expert pair is kept (a token
    picks an expert once, and no capacity drops any): the busiest expert takes at most every
    token, ``experts / top_k`` times its even share."""
    if experts > 1 and math.isfinite(imbalance) and imbalance * top_k > experts:
        raise InvalidInputError(
            f"moe.imbalance={imbalance:g}: the busiest expert would take more tokens than the "
            f"step has; at most {experts / top_k:g} for {experts} experts, top-{top_k} routing"
        )
    return expert_loads(tokens * top_k, experts, tokens, imbalance)


def _expert_slots(loads: list[int], device: torch.device) -> Iterator[tuple[int, torch.Tensor]]:
    """(expert, its slots) for every expert with a load: consecutive slots in expert order."""
    start = 0
    for expert, count in enumerate(loads):
        if count:
            with torch.no_grad():
                slots = torch.arange(start, start + count, device=device)
            yield expert, slots  # outside no_grad: the caller's expert math needs its grads
        start += count


def _runs(loads: list[int]) -> list[tuple[int, int, int]]:
    """(first expert, experts, tokens each) for each run of consecutive equal loads."""
    runs: list[tuple[int, int, int]] = []
    for expert, count in enumerate(loads):
        if runs and runs[-1][2] == count:
            first, n, _ = runs[-1]
            runs[-1] = (first, n + 1, count)
        else:
            runs.append((expert, 1, count))
    return [r for r in runs if r[2] > 0]


def _grouped(x: torch.Tensor, weight: torch.Tensor, bias: Any, transposed: bool) -> torch.Tensor:
    """One batched GEMM for experts with equal loads: x (g, n, in) by weight (g, out, in)."""
    out = torch.bmm(x, weight if transposed else weight.transpose(1, 2))
    return out + bias[:, None, :] if bias is not None else out


def _fused_experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """transformers' grouped_mm expert path (its default since 5.0) with even, fixed routing.

    grouped_mm gathers the token-expert pairs in expert order, runs one grouped GEMM per
    projection and scatters the weighted rows back. Equal loads make a grouped GEMM a
    batched one, so each run of experts with the same load is one ``bmm`` per projection
    (one run when routing is even; up to three with ``moe_imbalance``).
    """
    tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[-1]
    loads = topk_loads(tokens, top_k, self.num_experts, self.boom_imbalance)
    with torch.no_grad():
        # pair p (token p // top_k) goes to the expert whose slot range holds p
        pairs = torch.arange(tokens * top_k, device=hidden_states.device)
        token_idx = torch.div(pairs, top_k, rounding_mode="floor")
    rows = hidden_states[token_idx]  # the sorted gather
    outs = []
    start = 0
    for first, experts, count in _runs(loads):
        last = first + experts
        x = rows[start : start + experts * count].view(experts, count, hidden)
        start += experts * count
        if self.has_gate:
            bias = self.gate_up_proj_bias[first:last] if self.has_bias else None
            proj = _grouped(x, self.gate_up_proj[first:last], bias, self.is_transposed)
            proj = self._apply_gate(proj.reshape(experts * count, -1))
        else:
            bias = self.up_proj_bias[first:last] if self.has_bias else None
            proj = _grouped(x, self.up_proj[first:last], bias, self.is_transposed)
            proj = self.act_fn(proj.reshape(experts * count, -1))
        bias = self.down_proj_bias[first:last] if self.has_bias else None
        proj = proj.view(experts, count, -1)
        out = _grouped(proj, self.down_proj[first:last], bias, self.is_transposed)
        out = out.reshape(experts * count, hidden)
        if getattr(self, "has_post_expert_norm", False):
            out = self.post_expert_norm(out)
        outs.append(out)
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    out = out * top_k_weights.reshape(-1)[:, None]
    out = out[pairs]  # the unsort gather (identity order here, the same kernel)
    return out.view(tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)


def _switch_router_forward(self: nn.Module, hidden_states: torch.Tensor) -> tuple:
    """Switch's top-1 router without ``self.classifier.to(dtype)``.

    That call re-assigns the classifier's parameters inside the forward, which fails on fake
    tensors ("Couldn't swap Linear.weight"); with fp32 master weights it is a no-op anyway,
    so the weight is cast in the expression (free when it already has the router's dtype).
    """
    self.input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(self.dtype)
    if self.training and self.jitter_noise > 0:
        noise = torch.empty_like(hidden_states).uniform_(
            1.0 - self.jitter_noise, 1.0 + self.jitter_noise
        )
        hidden_states = hidden_states * noise
    bias = self.classifier.bias
    router_logits = F.linear(
        hidden_states,
        self.classifier.weight.to(self.dtype),
        bias.to(self.dtype) if bias is not None else None,
    )
    router_probs = F.softmax(router_logits, dim=-1, dtype=self.dtype).to(self.input_dtype)
    expert_index = F.one_hot(torch.argmax(router_probs, dim=-1), num_classes=self.num_experts)
    # the capacity mask the GPU computes; the experts below apply the capacity themselves
    token_priority = torch.cumsum(expert_index, dim=-2)
    expert_index = expert_index * (token_priority <= self.expert_capacity)
    router_probs = torch.max(router_probs, dim=-1).values.unsqueeze(-1)
    return expert_index, router_probs, router_logits


def _switch_sparse_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Switch's sparse MLP: top-1, capacity per sequence, even routing within each sequence."""
    batch, seq, hidden = hidden_states.shape
    _, routing_weights, _ = self.router(hidden_states)
    experts = self.router.num_experts
    capacity = self.router.expert_capacity or seq
    per_seq = expert_loads(seq, experts, min(capacity, seq), self.boom_imbalance)
    flat = hidden_states.reshape(-1, hidden)
    weights = routing_weights.reshape(-1)
    final = torch.zeros_like(flat)
    for expert, pos in _expert_slots(per_seq, flat.device):
        # the same positions in every sequence of the batch
        with torch.no_grad():
            token_idx = (torch.arange(batch, device=flat.device)[:, None] * seq + pos).reshape(-1)
        out = self.experts[f"expert_{expert}"](flat[token_idx]) * weights[token_idx, None]
        final.index_add_(0, token_idx, out.to(final.dtype))
    return final.reshape(batch, seq, hidden)


def _dbrx_experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """DBRX's expert loop (per expert: gather its tokens, GLU from its slice of the stacked
    w1 / v1 / w2, scale, ``index_add_`` back) with even, fixed routing."""
    batch = hidden_states.shape[0]
    flat = hidden_states.reshape(-1, self.hidden_size)
    tokens, top_k = flat.shape[0], top_k_index.shape[-1]
    loads = topk_loads(tokens, top_k, self.num_experts, self.boom_imbalance)
    final = torch.zeros_like(flat)
    split = (-1, self.ffn_hidden_size, self.hidden_size)
    for expert, pairs in _expert_slots(loads, flat.device):
        with torch.no_grad():  # pair p is token p // top_k's (p % top_k)-th choice
            token_idx = torch.div(pairs, top_k, rounding_mode="floor")
            choice = pairs - token_idx * top_k
        w1 = self.mlp.w1.view(split)[expert]
        v1 = self.mlp.v1.view(split)[expert]
        w2 = self.mlp.w2.view(split)[expert]
        states = self.mlp(flat[token_idx], w1, v1, w2)
        states = states.view(-1, self.hidden_size) * top_k_weights[token_idx, choice, None]
        final.index_add_(0, token_idx, states)
    return final.view(batch, -1, self.hidden_size)


def _is_fused_experts(module: nn.Module) -> bool:
    """transformers' ``@use_experts_implementation`` experts: 3-D weights, top-k inputs."""
    return all(
        hasattr(module, a) for a in ("has_gate", "is_transposed", "num_experts", "down_proj")
    )


def is_expert_block(module: nn.Module) -> bool:
    """A module holding a MoE layer's experts as stacked weights, not as ``nn.Linear``
    layers: transformers' fused experts (3-D), DBRX's own (2-D, experts x ffn rows)."""
    return _is_fused_experts(module) or type(module).__name__ == "DbrxExperts"


def patch_moe(model: nn.Module, imbalance: float = DEFAULT_IMBALANCE) -> int:
    """Route every MoE layer of ``model`` evenly (see the module docstring); returns how many.

    Unknown MoE designs are left alone: if they ask for data-dependent shapes, the trace
    names the op that failed.
    """
    expert_loads(1, 1, 1, imbalance)  # validates imbalance even for dense models
    patched = 0
    for module in model.modules():
        name = type(module).__name__
        if _is_fused_experts(module):
            module.boom_imbalance = imbalance
            module.forward = types.MethodType(_fused_experts_forward, module)
            patched += 1
        elif name == "DbrxExperts":
            module.boom_imbalance = imbalance
            module.forward = types.MethodType(_dbrx_experts_forward, module)
            patched += 1
        elif name == "SwitchTransformersSparseMLP":
            module.boom_imbalance = imbalance
            module.forward = types.MethodType(_switch_sparse_forward, module)
            module.router.forward = types.MethodType(_switch_router_forward, module.router)
            patched += 1
    return patched
