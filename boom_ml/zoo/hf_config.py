"""The configs of ``hf:`` models: where one comes from (a shipped config, a local file or
folder, a hub id through the local cache or ``hf_hub``), its parsing into a transformers
config with the user's ``model_options`` checked first (a misspelled field, a negative count),
and the class defaults a config may leave out (``is_encoder_decoder``).
"""

from __future__ import annotations

import difflib
import functools
import inspect
import json
import re
from pathlib import Path
from typing import Any

import boom_ml.zoo.hf_hub as hf_hub
from boom_ml.errors import InvalidInputError, UnknownModelError, last_line, suggest
from boom_ml.hf_shipped import lookup as _lookup
from boom_ml.hf_shipped import shipped, shipped_at_revision
from boom_ml.zoo.common import closest


def config_path(name: str) -> Path:
    """A shipped id, a ``config.json`` path, a folder containing one, or a hub id.

    Hub ids (``org/name``) come from the local Hugging Face cache, else their config.json
    alone is downloaded unless ``HF_HUB_OFFLINE`` is set (``hf_hub``); an id without an org
    (``roberta-base``) comes from the cache only.
    """
    mid = _lookup(name)
    if mid is not None:
        return shipped()[mid]
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path / "config.json"
    if path.is_file():
        return path
    at_revision = shipped_at_revision(name)
    if at_revision is not None:  # a shipped id at a revision: from the hub (an id without an
        try:  # org, gpt2, is a hub id too), spelt as the hub spells it
            return hf_hub.fetch_config(at_revision)
        except UnknownModelError as err:
            base = name.partition("@")[0]
            raise UnknownModelError(f"{err} (hf:{base} alone is the shipped config)") from err
    if hf_hub.looks_like_repo_id(name):
        try:
            return hf_hub.fetch_config(name)
        except UnknownModelError as err:
            # an -Instruct / -chat variant has its base model's architecture: say which (by
            # name alone: pythia-70m had been told gpt-neo-125M was its family; and not for a
            # revision, whose model the cache may hold)
            hits = [] if "@" in name else closest(name, list(shipped()))
            if not hits:
                raise
            close = ", ".join("hf:" + h for h in hits)
            raise UnknownModelError(f"{err} (shipped, close in name: {close})") from err
    bare = ""
    if hf_hub.looks_like_bare_id(name):
        cached = hf_hub.cached_config(name)
        if cached is not None:
            return cached
        bare = (
            f"; an id without an org is read from the local Hugging Face cache only "
            f"({hf_hub.cache_dir()}): {hf_hub.download_hint(name)} puts it there"
        )
    hits = closest(name, list(shipped()))
    hint = f" (did you mean: {', '.join('hf:' + h for h in hits)}?)" if hits else ""
    raise UnknownModelError(
        f"unknown hf model {name!r}{hint}; pass a hub id (org/name), a local config.json "
        f"(or a folder holding one), or a shipped id (`python -m boom_ml.models` lists them)"
        f"{bare}"
    )


def read_config(path: Path) -> dict[str, Any]:
    """A config.json's fields as written, checked to be an object with a model_type."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InvalidInputError(f"malformed HF config {path}: {err}") from err
    if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
        raise InvalidInputError(f"malformed HF config {path}: needs a JSON object with model_type")
    return raw


def load_config(
    path: Path, overrides: dict[str, Any] | None = None, raw: dict[str, Any] | None = None
) -> Any:
    """Parse a config.json into a transformers config (overrides applied first); ``raw``: its
    fields already read (``read_config``), left as they are."""
    from transformers import AutoConfig

    raw = dict(raw) if raw is not None else read_config(path)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    check_fields(raw, overrides or {})
    for key, value in (overrides or {}).items():
        # a depth given: the per-layer lists follow it (Qwen2's layer_types had refused
        # num_hidden_layers=4 for a 2-layer config: a hunt), unless the overrides set them
        if LAYER_COUNT.match(key) and type(value) is int and value > 0:
            lists = layer_lists(raw, raw.get(key), value)
            raw.update({k: v for k, v in lists.items() if k not in overrides})
    raw.update(overrides or {})

    if raw["model_type"] not in CONFIG_MAPPING:  # transformers' own error lists every type
        remote = " (code from the hub, auto_map: not run here)" if raw.get("auto_map") else ""
        raise InvalidInputError(
            f"HF config {path}: transformers has no model_type {raw['model_type']!r}{remote}"
            f"{suggest(raw['model_type'], CONFIG_MAPPING.keys())}"
        )
    # Generation-only settings (Gemma's "hybrid" KV cache) say nothing about a training step,
    # and transformers 5 warns about them on every build.
    raw.pop("cache_implementation", None)
    if isinstance(raw.get("architectures"), str):  # one class written bare: a list of one
        raw["architectures"] = [raw["architectures"]]
    if (
        encoder_decoder(raw)
        and raw.get("decoder_start_token_id") is None
        and _init_default(raw["model_type"], "decoder_start_token_id") is None
    ):
        # T5-family decoders start from the pad token (every published T5 / Switch config
        # says so); configs written by hand (NeuSight's switchxl4) leave it out, and the
        # model's label shift needs it.
        raw["decoder_start_token_id"] = raw.get("pad_token_id", 0)
    try:
        return AutoConfig.for_model(**raw)
    except Exception as err:  # noqa: BLE001 - transformers 5 validates through huggingface_hub's
        # strict dataclasses, whose errors are no ValueError: a bad field is one line all the same
        raise InvalidInputError(f"HF config {path}: {last_line(err)}") from err


def layer_lists(raw: dict[str, Any], depth: Any, layers: int) -> dict[str, Any]:
    """Per-layer config lists (a config checks that they match its depth: GPT-Neo's
    attention_layers, newer models' layer_types) for ``layers`` layers: cut to the first ones,
    or repeated in their pattern for more (the alternating sliding and full attention), and
    GPT-Neo's run-length attention_types rebuilt from them (transformers expands it again)."""
    if not isinstance(depth, int) or depth < 1:
        return {}
    out = {k: [v[i % depth] for i in range(layers)] for k, v in raw.items()
           if isinstance(v, list) and len(v) == depth}  # fmt: skip
    runs = raw.get("attention_types")
    if isinstance(runs, list) and all(isinstance(r, list) and len(r) == 2 for r in runs):
        expanded = [kind for kinds, n in runs for _ in range(int(n)) for kind in kinds]
        if expanded:
            kinds = [expanded[i % len(expanded)] for i in range(layers)]
            out["attention_types"] = [[kinds, 1]]
            if "attention_layers" in raw:
                out["attention_layers"] = kinds
    return out


def encoder_decoder(raw: dict[str, Any]) -> bool:
    """The config's ``is_encoder_decoder``, else its class's default (T5's is True)."""
    if "is_encoder_decoder" in raw:
        return bool(raw["is_encoder_decoder"])
    return _init_default(str(raw.get("model_type")), "is_encoder_decoder") is True


@functools.lru_cache(maxsize=256)
def _init_default(model_type: str, field: str) -> Any:
    """The default of ``field`` in the model_type's config constructor (None without one);
    cached: a layout search asks it of every candidate (830 signatures, 2 s, per search)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        return None
    param = inspect.signature(CONFIG_MAPPING[model_type].__init__).parameters.get(field)
    return None if param is None or param.default is inspect.Parameter.empty else param.default


# Config fields that count or size something (num_hidden_layers, hidden_size, n_head, ...).
COUNT_FIELD = re.compile(r"^(num|n)_|_(size|layers|heads|dim|experts)$")


# widths and counts every layer uses, where 0 builds empty tensors or divides by zero (the
# common names across transformers' configs: Llama, GPT-2, T5, BERT, OPT)
CORE_SIZE = re.compile(
    r"(hidden_size|intermediate_size|vocab_size|num_attention_heads|num_key_value_heads|"
    r"head_dim|n_embd|n_head|n_inner|d_model|d_ff|d_kv|num_heads|ffn_dim|num_labels|"
    r"max_position_embeddings|n_positions|encoder_ffn_dim|decoder_ffn_dim|"
    r"(en|de)coder_attention_heads)$"
)

# the fields that count a model's layers (GPT-2's n_layer, T5's num_decoder_layers, BART's
# encoder_layers, ...)
LAYER_COUNT = re.compile(
    r"(num_hidden_layers|n_layers?|num_layers|num_(en|de)coder_layers|(en|de)coder_layers)$"
)


def check_fields(raw: dict[str, Any], overrides: dict[str, Any]) -> None:
    """Refuse an override that looks like a misspelled config field: unknown to the config
    and its class, and close to a name that is known (transformers accepts any name and
    ignores it: n_layr=2 would build all 12 layers). Names a model reads without declaring
    them (head_dim, num_labels) are not close to another and pass."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for key, value in (overrides or {}).items():
        if (
            type(value) is int
            and value == 0
            and LAYER_COUNT.match(key)
            and _init_default(raw.get("model_type", ""), key) != 0  # where 0 is a choice
        ):
            # zero layers built an embedding and its head alone, without a word (a hunt)
            raise InvalidInputError(
                f"model_options.{key}=0 leaves the model without layers; give at least 1"
            )
        if type(value) is int and value == 0 and CORE_SIZE.match(key):
            # a zero width built a model of empty tensors (30 lines of numpy's divide-by-zero
            # warnings, then a table of "0 parameters") or failed deep in torch (a hunt)
            raise InvalidInputError(f"model_options.{key}=0 builds empty layers (a width or head"
                                    " count of 0); give at least 1")  # fmt: skip
        # a count or size below zero builds as if it were zero (num_hidden_layers=-1: no layer);
        # a field whose own default is negative (ViLT's num_images=-1) means something by it
        if type(value) is int and value < 0 and COUNT_FIELD.search(key):
            known = raw.get("model_type") in CONFIG_MAPPING
            default = _init_default(raw["model_type"], key) if known else None
            if type(default) is int and default < 0:
                continue
            raise InvalidInputError(
                f"model_options.{key}={value}: a count or size cannot be negative"
            )
    heads, kv = (
        {**raw, **overrides}.get(k) for k in ("num_attention_heads", "num_key_value_heads")
    )
    if type(heads) is int and type(kv) is int and heads > 0 and kv > 0 and heads % kv:
        # grouped-query attention repeats each key/value head for heads / kv query heads; it
        # had failed in the trace on a shape mismatch naming neither field (a hunt)
        raise InvalidInputError(
            f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv}):"
            " grouped-query attention shares each key/value head among as many query heads"
        )
    if not overrides or raw.get("model_type") not in CONFIG_MAPPING:
        return
    cls = CONFIG_MAPPING[raw["model_type"]]
    try:
        defaults = cls().to_dict()
    except Exception:  # noqa: BLE001 - a config class that needs arguments: nothing to compare
        return
    known = {*raw, *defaults, *getattr(cls, "attribute_map", {}),
             *inspect.signature(cls.__init__).parameters}  # fmt: skip
    for key in overrides:
        close = [] if key in known else difflib.get_close_matches(key, sorted(known), 1, 0.85)
        if close:
            raise InvalidInputError(
                f"model_options.{key}: {cls.__name__} has no field {key!r} (did you mean: "
                f"{close[0]}?)"
            )
