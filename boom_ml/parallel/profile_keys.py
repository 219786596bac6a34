"""The keys of the layout search's profile caches, in memory and on disk.

A profile is keyed by what it was computed from: the per-rank config, the step, the GPU, and
the identity of the code and models that computed it (:func:`timing_identity`,
:func:`memory_identity`), so a retrained model or changed code never serves an old profile.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from boom_ml.gpus.spec import GpuSpec
from boom_ml.parallel.shard import cache_dir
from boom_ml.specs import StepSpec

CACHE_VERSION = 15  # 4: recipes in the parameter split; 7: peaks per window (optimizer, rest);
# 8: bytes a micro-batch holds between its passes (MemoryProfile.held); 9: peaks per part
# of the step (forward, loss, backward, optimizer), not optimizer and the rest; 10: what the
# head's modules (those after the last layer) hold at each part's peak (windows[...]["head"]);
# 12: gradient accumulation's adds per layer and of the ends (TimeProfile.accumulate_*);
# 13: the parameters the model stands for (param_counts' logical_*: QLoRA's 4-bit weights);
# 14: LoRA adapters in fp32 by default, as peft's get_peft_model makes them (adapter_dtype);
# held (per micro-batch in flight) without autocast's weight copies, which one region shares
# 15: each role's largest trainable tensor and count (MemoryProfile.largest, .tensors)
_ROOT = Path(__file__).resolve().parent.parent


def _files_digest(seed: str, files: list[Path]) -> str:
    digest = hashlib.sha1(seed.encode())
    for path in files:
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def timing_identity() -> str:
    """Hash of what a time profile is computed with: the timing code and the packaged (or
    ``$BOOM_PER_OP_MODEL``) models' manifests. In the disk key, so a retrained model or a
    changed timing rule never serves profiles timed by the previous one."""
    files = sorted((_ROOT / "timing").glob("*.py"))
    files += [_ROOT / "parallel" / "profile.py"]  # how a profile is timed (its TF32 switches)
    files += sorted((_ROOT / "artifacts").glob("*/manifest.json"))
    return _files_digest(os.environ.get("BOOM_PER_OP_MODEL", ""), files)


@functools.lru_cache(maxsize=1)
def memory_identity() -> str:
    """Hash of what a memory profile is computed with: the tracer and the model zoo (the trace
    cache's ``code_digest``) and the memory model (code and overhead table). In the disk key,
    for the same reason as :func:`timing_identity`: a profile replayed by older code is never
    served."""
    from boom_ml.trace_cache import code_digest

    memory = _ROOT / "memory"
    files = sorted([*memory.glob("*.py"), *memory.glob("*.csv")])
    # what a profile holds (its fields) and how its traces are taken
    files += [_ROOT / "parallel" / "memory_profile.py", _ROOT / "parallel" / "profile.py"]
    return _files_digest(code_digest(), files)


def key_of(*parts: Any) -> str:
    return _digest([canonical_json(p) for p in parts])


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _digest(texts: list[str]) -> str:
    """The key of parts given as their JSON: ``json.dumps`` of a list joins its items' texts
    with ", ", so this is the key :func:`key_of` makes of the parts themselves."""
    text = "[" + ", ".join([canonical_json(CACHE_VERSION), *texts]) + "]"
    return hashlib.sha1(text.encode()).hexdigest()[:20]


# A layout search asks for the time and memory keys of every (layout, GPU): 36k times for
# 207 layouts on 44 GPUs, 70 us each, of a few distinct (tp, step, GPU). Only the config is
# serialised per call (a dict: not hashable); the rest of each key is cached.
@functools.lru_cache(maxsize=4096)
def key_around(before: tuple[Any, ...], raw_json: str, after: tuple[Any, ...]) -> str:
    """``key_of(*before, raw, *after)``, a StepSpec or GpuSpec among the parts as its dict."""

    def text(part: Any) -> str:
        if isinstance(part, StepSpec):
            return canonical_json(part.to_dict())
        return canonical_json(asdict(part) if isinstance(part, GpuSpec) else part)

    return _digest([*map(text, before), raw_json, *map(text, after)])


def time_key(raw: dict[str, Any], tp: int, step: StepSpec, gpu: GpuSpec) -> str:
    # = key_of("time", timing_identity(), raw, tp, step.to_dict(), asdict(gpu))
    return key_around(("time", timing_identity()), canonical_json(raw), (tp, step, gpu))


def disk_get(kind: str, key: str) -> dict[str, Any] | None:
    path = cache_dir() / f"{kind}-{key}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def disk_put(kind: str, key: str, value: dict[str, Any]) -> None:
    path = cache_dir() / f"{kind}-{key}.json"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)
