"""Repeated blocks in module paths: ``h.3.attn`` and ``h.17.attn`` are one kind of block.

A transformer's 36 layers, or a ResNet stage's bottlenecks, each get their own module path
(``transformer.h.0.attn`` ... ``transformer.h.35.attn``), so a list of the costliest modules
fills with copies of one block and hides what the blocks cost together. ``group_by_block``
folds such paths into ``transformer.h.*.attn`` with a block count and a total.

An index is folded only where the numbered module has submodules of its own (a block), so
that the numbered layers of a plain ``nn.Sequential`` (VGG's ``features.0`` conv,
``features.1`` ReLU) stay apart: they are different layers, not copies of one block.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from types import MappingProxyType

# "0", "12" (nn.ModuleList, nn.Sequential) or "encoder_layer_3" (torchvision's ViT)
_INDEX = re.compile(r"^(?:\d+|(.+_)\d+)$")


def _indexed(segment: str) -> str | None:
    """``segment`` with its index replaced by ``*``; None when it carries no index."""
    m = _INDEX.match(segment)
    if m is None:
        return None
    return f"{m.group(1) or ''}*"


def block_kinds(paths: Iterable[str], known: Iterable[str] = ()) -> Mapping[str, str]:
    """Each path → its kind: the path with the index of every numbered block made ``*``.

    ``known``: more module paths of the same model (a graph's modules), which say which
    numbered modules have submodules where ``paths`` holds only the blocks themselves (the
    memory live at a peak under checkpointing: each layer's saved input). Cached on the
    paths: a prediction for many GPUs folds one graph's modules per GPU.
    """
    return _block_kinds(tuple(dict.fromkeys(paths)), tuple(dict.fromkeys(known)))


@functools.lru_cache(maxsize=8)
def _block_kinds(paths: tuple[str, ...], known: tuple[str, ...] = ()) -> Mapping[str, str]:
    containers = set()
    for path in (*paths, *known):
        parts = path.split(".")
        containers.update(".".join(parts[:k]) for k in range(1, len(parts)))
    kinds = {}
    for path in paths:
        parts = path.split(".")
        out = list(parts)
        for i, part in enumerate(parts):
            star = _indexed(part)
            if i > 0 and star is not None and ".".join(parts[: i + 1]) in containers:
                out[i] = star
        kinds[path] = ".".join(out)
    return MappingProxyType(kinds)  # shared by every caller of the cache: read-only


def group_by_block(
    values: Iterable[tuple[str, float]],
    key: str,
    top_n: int | None = None,
    known: Iterable[str] = (),
) -> list[dict[str, object]]:
    """Sum ``(path, value)`` pairs per block kind, largest first.

    ``known``: the model's other module paths (:func:`block_kinds`). Returns
    ``[{"module": kind, "blocks": paths folded into it, key: total}]``; a path that
    is no repeated block keeps its name with ``blocks`` 1.
    """
    pairs = list(values)
    kinds = block_kinds((path for path, _ in pairs), known)
    return _ranked(((kinds[path], path, value) for path, value in pairs), key)[:top_n]


def block_totals(values: Iterable[tuple[str, float]], key: str) -> list[dict[str, object]]:
    """Whole repeated blocks: every path under a block kind (its children included) summed
    into the kind of its first repeated block, ``transformer.h.*`` with ``blocks``: 36;
    largest first. Paths outside any repeated block are left out."""
    pairs = list(values)
    blocks = _blocks(tuple(dict.fromkeys(path for path, _ in pairs)))
    return _ranked(((*blocks[p], v) for p, v in pairs if p in blocks), key)


@functools.lru_cache(maxsize=8)
def _blocks(paths: tuple[str, ...]) -> Mapping[str, tuple[str, str]]:
    """Path → (kind of its first repeated block, that block's own path), for paths inside one."""
    out = {}
    for path, kind in _block_kinds(paths).items():
        parts = kind.split(".")
        stars = [i for i, p in enumerate(parts) if p.endswith("*")]
        if stars:
            cut = stars[0] + 1
            out[path] = (".".join(parts[:cut]), ".".join(path.split(".")[:cut]))
    return MappingProxyType(out)


def _ranked(rows: Iterable[tuple[str, str, float]], key: str) -> list[dict[str, object]]:
    """``(kind, member path, value)`` rows summed per kind, largest first, with the number of
    distinct member paths as ``blocks``."""
    totals: dict[str, float] = {}
    members: dict[str, set[str]] = {}
    for kind, member, value in rows:
        totals[kind] = totals.get(kind, 0) + value
        members.setdefault(kind, set()).add(member)
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])
    return [{"module": kind, "blocks": len(members[kind]), key: total} for kind, total in ranked]
