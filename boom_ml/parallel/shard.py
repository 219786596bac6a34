"""The per-rank model: an HF config with its tensor-parallel dimensions divided and its layers cut.

Megatron-style tensor parallelism splits attention heads, the MLP's intermediate size and the
vocabulary (embedding and LM head) by ``tp`` and keeps the hidden size; a pipeline stage holds
``layers / pp`` layers. We build that rank's model by editing the HF config the zoo would use
and writing it to a cached json that ``hf:<path>`` loads (the zoo is not edited).

Head width must stay ``hidden / heads`` when the heads are divided, so tp > 1 needs an
architecture whose attention reads ``head_dim`` from the config (``HEAD_DIM_TYPES``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from boom_ml.errors import InvalidInputError
from boom_ml.parallel.layout import Layout
from boom_ml.specs import BUILD_OPTION_KEYS, HF_LAYER_KEYS

# Architectures whose attention projections are heads * config.head_dim wide (not hidden).
HEAD_DIM_TYPES = (
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "gemma",
    "gemma2",
    "gemma3_text",
    "nemotron",
    "olmo2",
)
HEAD_KEYS = ("num_attention_heads", "n_head", "num_heads")
HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model")
INTERMEDIATE_KEYS = (
    "intermediate_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
)
# A parameter or module path with a numeric component is inside a repeated block (a layer).
LAYER_PATH = re.compile(r"\.\d+(\.|$)")
EMBEDDING_PATH = re.compile(r"(embed|wte|wpe)", re.IGNORECASE)


# cache=off: the folder the per-rank configs and profiles of the current call go to instead
_SCRATCH: list[Path] = []


@contextlib.contextmanager
def scratch_cache() -> Iterator[None]:
    """``cache=off``: nothing is read from or stored in the on-disk cache; the per-rank
    configs (which the zoo loads by path) and profiles of the call live in a temporary
    folder, removed after it."""
    with tempfile.TemporaryDirectory(prefix="boom_ml_parallel_") as tmp:
        _SCRATCH.append(Path(tmp))
        try:
            yield
        finally:
            _SCRATCH.pop()


def cache_dir() -> Path:
    if _SCRATCH:
        return _SCRATCH[-1]
    # the project's cache root (boom_ml/trace_cache.py); tests point it at a temporary folder
    root = os.environ.get("BOOM_CACHE_DIR") or os.path.join(Path.home(), ".cache", "boom_ml")
    path = Path(root) / "parallel"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _first(raw: dict[str, Any], keys: tuple[str, ...]) -> tuple[str | None, Any]:
    for key in keys:
        if raw.get(key) is not None:
            return key, raw[key]
    return None, None


def model_facts(raw: dict[str, Any]) -> dict[str, int | None]:
    """Heads, key/value heads, hidden size and layers of an HF config dict (None if absent)."""
    _, heads = _first(raw, HEAD_KEYS)
    _, hidden = _first(raw, HIDDEN_KEYS)
    _, layers = _first(raw, HF_LAYER_KEYS)
    kv = raw.get("num_key_value_heads") or heads
    return {"heads": heads, "kv_heads": kv, "hidden": hidden, "layers": layers}


def shape_problem(raw: dict[str, Any]) -> str | None:
    """Why a config is not one stack of equal layers the per-rank traces can cut (None if it
    is): stages of different widths (Swin's heads per stage), no layer count in the config
    (its class default applies), layers that share weights (ALBERT: a 1- and a 2-layer trace
    differ by no parameters, and every stage would need the shared ones)."""
    found = [_first(raw, keys) for keys in (HEAD_KEYS, HIDDEN_KEYS, HF_LAYER_KEYS)]
    staged = [f"{k}={v}" for k, v in found if isinstance(v, list | tuple)]
    if staged:
        return f"its layers come in stages of different sizes ({', '.join(staged)})"
    layers = found[2][1]
    if not isinstance(layers, int):
        return (f"its config names no layer count ({' / '.join(HF_LAYER_KEYS)}; the class"
                " default applies on one GPU): set one with model_options.num_hidden_layers=N")  # fmt: skip
    groups = raw.get("num_hidden_groups")
    if isinstance(groups, int) and groups < layers:
        return f"its {layers} layers share the weights of {groups} (num_hidden_groups)"
    return None


def config_facts(model: str) -> dict[str, int | None]:
    """``model_facts`` of a shipped HF config or a config file named by ``hf:<path>``, read
    without torch or transformers, so that a layout the model cannot take is refused before
    either is imported; {} for any other model (its facts come with its trace)."""
    from boom_ml.hf_shipped import lookup, shipped

    name = model.removeprefix("hf:")
    found = lookup(name)
    path = shipped()[found] if found is not None else Path(name).expanduser()
    if found is None and not (model.startswith("hf:") and path.suffix == ".json"):
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # the trace's own reading says what is wrong with it
    # a config the layouts cannot cut is refused by check_model, with its reason
    return model_facts(raw) if isinstance(raw, dict) and shape_problem(raw) is None else {}


def stage_layers(layers: int, pp: int) -> list[int]:
    """Layers of each pipeline stage: as even as possible, the remainder on the first stages."""
    base, extra = divmod(layers, pp)
    return [base + (1 if s < extra else 0) for s in range(pp)]


def chunk_layers(layers_per_stage: list[int], virtual_stages: int = 1) -> list[list[int]]:
    """Per pipeline rank, the layers of each of its ``virtual_stages`` model chunks.

    Interleaved 1F1B (Megatron-LM) gives rank r the chunks r, r + pp, r + 2 pp, ... of the
    model cut into pp * v equal chunks (``layout.validate`` requires the layers to divide);
    a rank's chunks then hold equal shares of its layers.
    """
    return [stage_layers(n, virtual_stages) for n in layers_per_stage]


def rank_config(raw: dict[str, Any], tp: int, layers: int) -> dict[str, Any]:
    """The config of one tensor-parallel rank with ``layers`` transformer layers."""
    out = dict(raw)
    key, _ = _first(raw, HF_LAYER_KEYS)
    if key is None:
        raise InvalidInputError("parallel layouts need an HF config with a layer count")
    out[key] = layers
    from boom_ml.zoo.hf_config import layer_lists  # the zoo's own resizing

    out.update(layer_lists(raw, raw[key], layers))
    if tp == 1:
        return out
    if raw.get("model_type") not in HEAD_DIM_TYPES:
        raise InvalidInputError(
            f"parallel.tp>1 is modelled for HF configs of type {', '.join(HEAD_DIM_TYPES)}; "
            f"{raw.get('model_type')!r} ties its head width to the hidden size"
        )
    hkey, heads = _first(raw, HEAD_KEYS)
    _, hidden = _first(raw, HIDDEN_KEYS)
    out.setdefault("head_dim", raw.get("head_dim") or hidden // heads)
    out[hkey] = heads // tp
    kv = raw.get("num_key_value_heads") or heads
    out["num_key_value_heads"] = kv // tp  # layout.validate: tp divides them
    for ikey in INTERMEDIATE_KEYS:
        if raw.get(ikey):
            out[ikey] = math.ceil(raw[ikey] / tp)
    out["vocab_size"] = math.ceil(raw["vocab_size"] / tp)
    # special token ids index the full vocabulary; on a shard they may not exist (an
    # embedding's padding_idx must): they change no shape of the step
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        ids = raw.get(key)
        if isinstance(ids, int) and ids >= out["vocab_size"] or isinstance(ids, list):
            out[key] = None
    return out


# Under this key a config carries the zoo's build options for its model (attention
# implementation, MoE imbalance): they change the trace, so every cache keyed on the config
# keys on them too; ``rank_model`` hands them to the ModelSpec, not to the config file.
BUILD_OPTIONS = "_boom_build_options"


def with_build_options(raw: dict[str, Any], options: dict[str, Any] | None) -> dict[str, Any]:
    """``raw`` with the config fields among ``options`` applied (``model_options``: what the
    model is, so every fact and every rank's cut starts from them), carrying the zoo's build
    choices (attention, MoE imbalance) for the ranks' builds."""
    fields = {k: v for k, v in (options or {}).items() if k not in BUILD_OPTION_KEYS}
    build = {k: v for k, v in (options or {}).items() if k in BUILD_OPTION_KEYS}
    if fields:
        from boom_ml.zoo.hf_config import check_fields  # transformers: only with fields

        check_fields(raw, fields)  # as a one-GPU build would (rank builds see no overrides)
    raw = {**raw, **fields}
    return {**raw, BUILD_OPTIONS: build} if build else raw


def rank_model(config_json: str) -> Any:
    """The ModelSpec of a rank config given as json: the config file and the build options."""
    from boom_ml.specs import ModelSpec

    config = json.loads(config_json)
    options = config.pop(BUILD_OPTIONS, None) or {}
    layers = config.get("num_hidden_layers", config.get("n_layer", "?"))
    label = f"{config.get('model_type', 'hf')}'s {layers}-layer per-rank model"
    return ModelSpec(f"hf:{config_file(config)}", options, label=label)


def config_file(raw: dict[str, Any]) -> Path:
    """Write ``raw`` once to the cache (named by its content) and return the path."""
    text = json.dumps(raw, sort_keys=True)
    digest = hashlib.sha1(text.encode()).hexdigest()[:16]
    path = cache_dir() / f"config-{digest}.json"
    if not path.exists():
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return path


def load_raw(model: str) -> dict[str, Any]:
    """The HF config dict behind ``hf:<id or path>`` (shipped, local, or hub cache), or
    behind a bare name the zoo finds among the hf configs alone (as one GPU's trace does)."""
    from boom_ml.zoo import resolve_name
    from boom_ml.zoo.hf_config import config_path  # the zoo's own resolution

    model = resolve_name(model)
    if not model.startswith("hf:"):
        raise InvalidInputError(f"parallel layouts support hf: models for now, got {model!r}")
    path = config_path(model[3:])
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise InvalidInputError(f"malformed HF config {path}: {err}") from err


def param_split(module: Any) -> dict[str, int]:
    """Parameter counts of a built (meta) module: layers, embedding (first stage), rest (last).

    Tied weights appear once (under the embedding); ``tied`` says whether the LM head is tied,
    because a pipeline's last stage then holds its own copy (Megatron's layout). The same
    counts prefixed ``trainable_`` hold the parameters that get gradients and optimizer state
    (all of them unless a recipe froze some: LoRA). ``bytes`` and ``trainable_bytes``: bytes
    per element of the parameters as held (``params_dtype``; fp32 by default) and of the
    trainable ones, hence of their gradients. ``logical_``: the parameters the model stands
    for, a 4-bit (QLoRA) layer's weights counted as weights, not as the bytes that hold them.
    ``largest_``: the largest trainable tensor of each role (one layer's, the embedding's, the
    rest's), elements: the gradient a rank holds whole while it waits for its reduction;
    ``tensors_``: how many trainable tensors each role has (the allocator rounds each).
    """
    counts = {"layers": 0, "first": 0, "last": 0, "tied": 0, "bytes": 4}
    counts |= {f"{p}_{k}": 0 for p in ("trainable", "logical")
               for k in ("layers", "first", "last", "tied")}  # fmt: skip
    counts["trainable_bytes"] = 4
    counts |= {f"{p}_{k}": 0 for p in ("largest", "tensors") for k in ("layers", "first", "last")}

    def role_of(name: str) -> str:
        return "layers" if LAYER_PATH.search(name) else (
            "first" if EMBEDDING_PATH.search(name) else "last")  # fmt: skip

    # bytes per element: the width most of the elements have (LoRA's fp32 adapters beside bf16
    # weights had set it when an adapter came last)
    widths: Counter[int] = Counter()
    trainable_widths: Counter[int] = Counter()
    for name, param in module.named_parameters():
        role = role_of(name)
        counts[role] += param.numel()
        counts[f"logical_{role}"] += param.numel()
        widths[param.element_size()] += param.numel()
        if param.requires_grad:
            counts[f"trainable_{role}"] += param.numel()
            counts[f"largest_{role}"] = max(counts[f"largest_{role}"], param.numel())
            counts[f"tensors_{role}"] += 1
            trainable_widths[param.element_size()] += param.numel()
    for key, seen in (("bytes", widths), ("trainable_bytes", trainable_widths)):
        if seen:
            counts[key] = seen.most_common(1)[0][0]
    for name, sub in module.named_modules():  # QLoRA's 4-bit layers: weights held as buffers
        logical = getattr(sub, "logical_numel", None)
        if isinstance(logical, int):
            counts[f"logical_{role_of(name)}"] += logical
    out_emb = getattr(module, "get_output_embeddings", lambda: None)()
    in_emb = getattr(module, "get_input_embeddings", lambda: None)()
    if out_emb is not None and in_emb is not None and out_emb.weight is in_emb.weight:
        counts["tied"] = counts["logical_tied"] = int(in_emb.weight.numel())
        counts["trainable_tied"] = counts["tied"] if in_emb.weight.requires_grad else 0
    return counts


def module_role(module_path: str) -> str:
    """'layer', 'first' (embedding) or 'last' (head, final norm, loss, top level)."""
    if LAYER_PATH.search(module_path):
        return "layer"
    if EMBEDDING_PATH.search(module_path):
        return "first"
    return "last"


def check_model(raw: dict[str, Any], layout: Layout) -> dict[str, int | None]:
    """The model facts a layout is validated against; one-line errors for the models the
    per-rank traces cannot cut (an encoder-decoder's two stacks of layers)."""
    from boom_ml.zoo.hf_config import (
        encoder_decoder,  # T5's class says so where its config is silent
    )

    if encoder_decoder(raw):
        raise InvalidInputError(
            f"parallel layouts cut one stack of layers; {raw.get('model_type')!r} is an "
            "encoder-decoder (an encoder and a decoder stack), which they do not model: "
            "predict it on one GPU"
        )
    problem = shape_problem(raw)
    if problem is not None:
        raise InvalidInputError(
            f"parallel layouts cut one stack of equal layers; {raw.get('model_type')!r}: "
            f"{problem}; predict it on one GPU"
        )
    facts = model_facts(raw)
    if layout.tp > 1 and raw.get("model_type") not in HEAD_DIM_TYPES:
        rank_config(raw, layout.tp, 1)  # raises the one-line error
    return facts
