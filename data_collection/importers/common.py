"""Shared pieces of the public-data importers: results, GPU-id resolution, small parsers."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from boom_ml.errors import UnknownGpuError

# Non-NVIDIA accelerators that the GPU database may not (yet) hold. Skipping their rows is
# the one allowed skip, and it is always counted and printed.
# Called once per unit of work so the CLI can advance a progress bar.
Progress = Callable[[], object]

_NON_NVIDIA = re.compile(r"\b(amd|instinct|mi\d{2,3}x?)\b", re.IGNORECASE)


@dataclass
class ImportResult:
    """What one importer produced: rows per (kind, source) plus printed notes."""

    frames: dict[tuple[str, str], pd.DataFrame] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # Rows per kind skipped because their device is non-NVIDIA and not in the GPU database.
    skipped_non_nvidia: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, source: str, df: pd.DataFrame) -> None:
        key = (kind, source)
        if key in self.frames:
            df = pd.concat([self.frames[key], df], ignore_index=True)
        self.frames[key] = df

    def note(self, text: str) -> None:
        self.notes.append(text)

    def skip(self, kind: str, rows: int) -> None:
        if rows:
            self.skipped_non_nvidia[kind] = self.skipped_non_nvidia.get(kind, 0) + rows


class GpuResolver:
    """Maps a source's device string to the GPU database's canonical id, with a cache.

    Unknown names raise (a silent skip would hide a whole GPU), except non-NVIDIA devices
    the database does not hold: those return None and the caller counts the skipped rows.
    """

    def __init__(self) -> None:
        # Imported here, not at module import, so that schema-only users need no GPU table.
        from boom_ml.gpus import resolve_gpu_id

        self._resolve = resolve_gpu_id
        self._cache: dict[str, str | None] = {}

    def __call__(self, name: str) -> str | None:
        if name not in self._cache:
            try:
                self._cache[name] = self._resolve(name)
            except UnknownGpuError:
                if not _NON_NVIDIA.search(name):
                    raise
                self._cache[name] = None
        return self._cache[name]

    def map(self, names: pd.Series) -> pd.Series:
        """Resolve every distinct name once; None where the device is skippable non-NVIDIA."""
        lookup = {n: self(n) for n in names.dropna().unique()}
        return names.map(lookup)


def require_file(path: Path) -> Path:
    """Return ``path`` or raise naming it: a missing source file must not shrink a dataset."""
    if not path.exists():
        raise FileNotFoundError(f"expected source file is missing: {path}")
    return path


def cuda_from_tag(tag: str) -> str:
    """'cu121' -> '12.1', 'cu113' -> '11.3', 'cu130' -> '13.0'."""
    digits = tag.removeprefix("cu")
    return f"{digits[:-1]}.{digits[-1]}"


def torch_from_tag(tag: str) -> str:
    """'pt112' -> '1.12', 'pt210' -> '2.1.0', 'pt291' -> '2.9.1', 'p2.1.0' -> '2.1.0'."""
    if tag.startswith("p") and "." in tag:
        return tag[1:]
    digits = tag.removeprefix("pt")
    if len(digits) == 3 and digits[0] == "1":  # pt112 / pt113: torch 1.12 / 1.13
        return f"1.{digits[1:]}"
    return ".".join(digits)


def cudnn_from_int(value: int | str) -> str:
    """cuDNN's integer version (8902) -> '8.9.2'."""
    v = int(value)
    return f"{v // 1000}.{(v % 1000) // 100}.{v % 100}"


def nonzero_or_none(value: float) -> float | None:
    """Sources write 0 for 'not measured'; a zero duration is never a real measurement."""
    return None if value is None or pd.isna(value) or float(value) == 0.0 else float(value)
