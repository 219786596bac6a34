"""A deep hf: model traced as a shallow one, one layer repeated (``trace/stretch.py``).

Tracing runs every op of every layer through PyTorch's fake-tensor dispatch and autograd,
~0.1 s per Llama-3-8B layer on two cores, the same work 32 times. A model whose config
gives every layer the same shape is traced with :data:`SHALLOW` layers and with one more
(k more after k dense first layers); the shallow graph's layer that has a layer like it on
each side, repeated once, must equal the deeper trace exactly (nodes,
edges and memory events, blocks renumbered), and only then is it repeated to the model's
depth. Anything else (a check that fails, a graph stretch.py cannot read, a config whose
layers differ by index) traces the whole model as before. ``$BOOM_REPEAT_LAYERS=0`` turns
it off.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass
from typing import Any

from torch import nn

from boom_ml.specs import HF_LAYER_KEYS, ModelSpec, StepSpec
from boom_ml.trace import repeat_enabled
from boom_ml.trace.graph import OpGraph
from boom_ml.trace.step import trace_step_with_blocks
from boom_ml.trace.stretch import (
    CannotRepeat,
    Delta,
    Tagged,
    canonical,
    difference,
    layer_pattern,
    repeat_layer,
)

SHALLOW = 3  # layers traced; layer 1, with a layer on each side, is the one repeated
# (after k dense first layers, DeepSeek's first_k_dense_replace: k + 3 layers, layer k + 1)
DENSE_FIRST_KEY = "first_k_dense_replace"
MIN_LAYERS = 8  # below this the two shallow traces cost about what the model's own does
# Config fields that make layers differ by index in a period longer than the check sees
# (sliding-window and MoE interleaving patterns): such models are traced whole.
PERIOD_KEYS = (
    "sliding_window_pattern",
    "decoder_sparse_step",
    "interleave_moe_layer_step",
    "moe_layer_freq",
    "no_rope_layer_interval",
    "global_attn_every_n_layers",
)
# ... and fields that set the first layers apart (dense before MoE) or name layers one by one
FIRST_KEYS = ("mlp_only_layers", "cross_attention_layers")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """How to trace a deep model shallow: its ``layers``, the ``repeated`` layer (a layer like
    it on each side), and per shallow depth (``repeated`` + 2, and one more) the config
    overrides that build it."""

    layers: int
    repeated: int
    options: dict[int, dict[str, Any]]

    @property
    def depth(self) -> int:
        return self.repeated + 2


def shallow_options(model: ModelSpec) -> Plan | None:
    """How to trace ``model`` shallow; None where it is not an hf: config with enough
    identical layers."""
    if not repeat_enabled():
        return None
    from boom_ml.zoo import resolve_name
    from boom_ml.zoo.hf_config import config_path, encoder_decoder, load_config
    from boom_ml.zoo.hf_models import split_options

    try:
        scheme, _, name = resolve_name(model.text).partition(":")  # a bare name too
        if scheme != "hf":
            return None
        path = config_path(name)
        raw = {**json.loads(path.read_text()), **model.options}
        # as transformers fills it in (Gemma 2's alternating layer_types are not in its json)
        built = load_config(path, split_options(model.options)[0]).to_dict()
    except Exception:  # noqa: BLE001 - the build reports a bad model, not this shortcut
        return None
    key = next((k for k in HF_LAYER_KEYS if isinstance(raw.get(k), int)), None)
    layers = raw.get(key) if key else None
    dense = raw.get(DENSE_FIRST_KEY) or 0
    repeated = dense + 1
    if not isinstance(dense, int) or layers is None or encoder_decoder(raw):
        return None
    if layers < max(MIN_LAYERS, 2 * (repeated + 2) + 2):  # the shallow traces hold 2n + 1
        return None
    if any(raw.get(k) not in (None, 0, 1, [], False) for k in PERIOD_KEYS) or any(
        raw.get(k) for k in FIRST_KEYS
    ):
        return None
    per_layer = {k: v for k, v in raw.items() if isinstance(v, list) and len(v) == layers}
    filled = [v for v in built.values() if isinstance(v, list) and len(v) == layers]
    if any(len({json.dumps(x) for x in v}) > 1 for v in [*per_layer.values(), *filled]):
        return None  # layers typed one by one (Gemma 2's and 3's sliding and global attention)
    options = {}
    for depth in (repeated + 2, repeated + 3):
        options[depth] = {key: depth, **{k: v[:depth] for k, v in per_layer.items()}}
    return Plan(layers, repeated, options)


def layer_list(module: nn.Module, depth: int) -> str | None:
    """The path of the one ModuleList of ``depth`` blocks (the model's layers), or None."""
    found = [
        n for n, m in module.named_modules() if isinstance(m, nn.ModuleList) and len(m) == depth
    ]
    outer = [n for n in found if not any(n.startswith(o + ".") for o in found if o != n)]
    return outer[0] if len(outer) == 1 else None


def trace_repeated(model: ModelSpec, step: StepSpec) -> OpGraph | None:
    """``step`` of ``model`` traced shallow and repeated to its depth, or None (trace it whole)."""
    plan = shallow_options(model)
    if plan is None:
        return None
    if step.checkpointing_every != 1 or _names_a_layer(step.lora_targets):
        log.info("tracing %s whole: checkpointing.every or LoRA targets name layers", model.text)
        return None
    from boom_ml.zoo import build_model

    layers, m, n = plan.layers, plan.repeated, plan.depth
    started = time.perf_counter()
    traced = []
    for depth in (n, n + 1):
        try:
            built = build_model(ModelSpec(model.text, {**model.options, **plan.options[depth]}))
            path = layer_list(built.module, depth)
            if path is None:
                return None
            traced.append(trace_step_with_blocks(built, step))
        except Exception as err:  # noqa: BLE001 - the whole model's trace says what is wrong
            log.info("tracing %s whole: %d layers did not trace: %s", model.text, depth, err)
            return None
    (shallow, notes), (deeper, _) = traced
    try:
        tagged = Tagged(shallow, notes, layer_pattern(path))
        check, mixed = repeat_layer(tagged, m, 2)
        why = difference(check, deeper, skip=set(mixed.values()))
        if why is not None:
            raise CannotRepeat(f"{n} layers repeated once differ from {n + 1}: {why}")
        delta: Delta = {
            old: tuple(
                int(deeper.nodes.at[new, c]) - int(shallow.nodes.at[old, c])
                for c in ("flops", "bytes_read", "bytes_written")
            )
            for old, new in mixed.items()
        }
        graph = canonical(repeat_layer(tagged, m, layers - n + 1, delta)[0])
        graph.meta = _meta(shallow.meta, deeper.meta, layers - n)
    except CannotRepeat as why:
        log.info("tracing %s whole: %s", model.text, why)
        return None
    graph.meta["trace_seconds"] = round(time.perf_counter() - started, 3)
    graph.meta["repeated_layers"] = {"traced": n, "checked": n + 1, "layers": layers}
    return graph


def _names_a_layer(targets: tuple[str, ...] | None) -> bool:
    """LoRA targets that name one layer (``layers.5.mlp.down_proj``): a shallow model has
    no such layer, and both shallow traces would agree on leaving it out."""
    return any(re.search(r"(^|\.)\d+(\.|$)", t) for t in targets or ())


def _meta(shallow: dict[str, Any], deeper: dict[str, Any], more: int) -> dict[str, Any]:
    """The deep model's meta: counts that grow by one layer's share (parameters, SDPA calls,
    checkpointed blocks, recipe bytes) extended by ``more`` layers; everything else as traced."""

    def extend(a: Any, b: Any) -> Any:
        if isinstance(a, bool) or a == b:
            return a
        if isinstance(a, int) and isinstance(b, int):
            return a + more * (b - a)
        if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
            return {k: extend(a[k], b[k]) for k in a}
        raise CannotRepeat(f"graph meta differs beyond a count: {a!r} against {b!r}")

    return {k: extend(v, deeper[k]) for k, v in shallow.items() if k != "trace_seconds"}
