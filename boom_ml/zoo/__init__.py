"""The model zoo: one string names a model, built on the meta device (no weights, no network).

Schemes::

    torchvision:<name>        torchvision.models classifiers, segmentation and video models
                              (weights=None)
    timm:<name>               any timm model (pretrained=False)
    hf:<id-or-path>           a shipped HF config id, or a local config.json / folder
    file:<path.py>:<factory>  a user's nn.Module factory (see boom_ml.zoo.file_models)
    <name>                    looked up in torchvision, timm, then shipped hf ids;
                              a name found in more than one is reported as ambiguous

``ModelSpec.options`` are constructor overrides: keyword arguments of the torchvision /
timm constructor or of the file factory, or config fields for hf (``num_hidden_layers``).
Two options are build choices of hf models rather than config fields:
``attn_implementation`` ("sdpa", the default, or "eager") and ``moe_imbalance`` (>= 1.0, the
busiest expert's share of tokens over an even share; see ``hf_moe``). Other schemes accept
them at their defaults (so a caller may always pass them) and reject other values.
"""

from __future__ import annotations

import torch

from boom_ml.errors import InvalidInputError, UnknownModelError
from boom_ml.specs import BUILD_OPTION_DEFAULTS, BUILD_OPTION_KEYS, MODEL_SCHEMES, ModelSpec
from boom_ml.zoo import file_models, hf_models, timm_models, torchvision_models
from boom_ml.zoo.base import BuiltModel
from boom_ml.zoo.common import closest

__all__ = ["BuiltModel", "SCHEMES", "build_model", "list_models", "resolve_name"]

SCHEMES = MODEL_SCHEMES
# Bare-name lookup order (file models always need their scheme).
_LOOKUP = (("torchvision", torchvision_models), ("timm", timm_models), ("hf", hf_models))
# hf build options and their defaults: meaningless for other schemes (the keys users type
# for them: specs.BUILD_OPTION_KEYS)
HF_BUILD_OPTIONS = BUILD_OPTION_DEFAULTS
_CLI_KEYS = BUILD_OPTION_KEYS
_BUILDERS = {
    "torchvision": torchvision_models.build,
    "timm": timm_models.build,
    "hf": hf_models.build,
    "file": file_models.build,
}


def list_models(scheme: str | None = None) -> list[str]:
    """Known model names as ``scheme:name``, for one scheme or all of them.

    ``file`` models are whatever the user writes, so that scheme lists nothing; ``hf``
    lists the shipped configs (any local config.json also works).
    """
    if scheme is not None and scheme not in SCHEMES:
        raise InvalidInputError(f"unknown scheme {scheme!r}; choose one of: {', '.join(SCHEMES)}")
    out: list[str] = []
    for name, mod in _LOOKUP:
        if scheme in (None, name):
            out.extend(f"{name}:{n}" for n in mod.names())
    return out


def resolve_name(text: str) -> str:
    """``scheme:name`` for a model string; a bare name is looked up in every scheme.

    Raises InvalidInputError when a bare name exists in several schemes and
    UnknownModelError (with close names from all schemes) when it exists in none.
    """
    spec = ModelSpec(text)
    if spec.scheme is not None:
        return text
    name = text.strip()
    if not name:
        raise UnknownModelError("empty model name")
    matches = [f"{scheme}:{name}" for scheme, mod in _LOOKUP if mod.has(name)]
    if len(matches) > 1:
        raise InvalidInputError(
            f"{name!r} is ambiguous: {', '.join(matches)}; prefix the one you mean"
        )
    if matches:
        return matches[0]
    head, sep, _ = name.partition(":")
    if sep and head and "/" not in head and "." not in head:
        raise UnknownModelError(
            f"unknown model scheme {head!r} in {name!r}; use one of: {', '.join(SCHEMES)}"
        )
    candidates = {n.partition(":")[2]: n for n in reversed(list_models())}
    hits = [candidates[h] for h in closest(name, list(candidates))]
    hint = f" (did you mean: {', '.join(hits)}?)" if hits else ""
    raise UnknownModelError(
        f"unknown model {name!r}{hint}; name it as torchvision:, timm:, hf: or file:"
    )


def build_model(spec: ModelSpec | str, device: str | torch.device = "meta") -> BuiltModel:
    """Build the named model on ``device`` (meta by default: no memory, nothing downloaded).

    ``device`` other than meta builds real, initialised weights with the same recipe
    (used where a real GPU run is measured).
    """
    if isinstance(spec, str):
        spec = ModelSpec(spec)
    if not isinstance(spec, ModelSpec):
        raise InvalidInputError(f"expected a model name or ModelSpec, got {type(spec).__name__}")
    full = resolve_name(spec.text)
    if full != spec.text:
        spec = ModelSpec(full, dict(spec.options))
    scheme, name = spec.scheme, spec.name
    assert scheme is not None  # resolve_name always returns scheme:name
    if not name:
        raise UnknownModelError(f"{spec.text!r} names no model after the scheme")
    if scheme != "hf":
        spec = ModelSpec(spec.text, _without_hf_options(spec))
    return _BUILDERS[scheme](spec, name, device)


def _without_hf_options(spec: ModelSpec) -> dict:
    """Drop hf-only build options left at their defaults; others are the user's mistake."""
    options = dict(spec.options)
    for key, default in HF_BUILD_OPTIONS.items():
        if key not in options:
            continue
        value = options.pop(key)
        if str(value) != str(default) and not (
            isinstance(value, (int, float)) and float(value) == float(default)
        ):
            raise InvalidInputError(
                f"{_CLI_KEYS[key]}={value} applies to hf: models only, not {spec.text}"
            )
    return options
