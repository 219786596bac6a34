"""The Hugging Face configs shipped with boom-ml (``zoo/hf_configs``), torch-free: outside the
zoo package (which imports torch), so the model listing and the trace cache read them
without it."""

from __future__ import annotations

import functools
from pathlib import Path

CONFIG_DIR = Path(__file__).parent / "zoo" / "hf_configs"


@functools.cache
def shipped() -> dict[str, Path]:
    """Model id -> shipped config path."""
    found = {p.stem.replace("--", "/"): p for p in CONFIG_DIR.glob("*.json")}
    return {k: found[k] for k in sorted(found, key=str.lower)}


def lookup(name: str) -> str | None:
    """The shipped id for ``name``: exact, safe-name or case-insensitive spelling, or the
    name without its org where one shipped id alone has it (``Qwen2.5-0.5B``)."""
    table = shipped()
    if name in table:
        return name
    wanted = name.replace("--", "/").lower()
    hits = [mid for mid in table if mid.lower() == wanted]
    if not hits and "/" not in wanted:
        hits = [mid for mid in table if mid.lower().rpartition("/")[2] == wanted]
    return hits[0] if len(hits) == 1 else None


def shipped_at_revision(name: str) -> str | None:
    """``id@revision`` of a shipped id given at a revision in any spelling ``lookup`` reads
    (``GPT2@main``, ``meta-llama--Llama-3.2-1B@v1``), as the hub names it; None for others."""
    base, _, revision = name.partition("@")
    found = lookup(base) if revision else None
    return f"{found}@{revision}" if found is not None else None
