"""On-disk cache of traced steps: the same model and step predicted again does not trace again.

Tracing dominates a prediction (seconds to minutes for large models); another GPU list,
another output format or a second run of the same command reuses the graph. An entry is a
directory ``<root>/<key>/`` holding :meth:`OpGraph.save`'s files. The key hashes everything
a graph depends on:

* the model spec (text and options), and for ``file:`` models and local HF configs the
  bytes of that file (editing your model file must not return the old graph), and of the
  ``.py`` files beside a ``file:`` model, which it may import;
* the requested :class:`StepSpec`;
* the installed torch, transformers, timm, torchvision, peft and bitsandbytes releases and
  ``boom_ml``'s;
* ``TRACE_VERSION`` and a digest of the tracer's and zoo's own source files (an edited
  tracer in a checkout must not be served its old graphs, bumped version or not).

The root is ``$BOOM_CACHE_DIR/traces`` (default ``~/.cache/boom_ml/traces``), capped at
``$BOOM_TRACE_CACHE_GB`` GiB (default 2): after each write the least recently used entries
(oldest mtime; a hit touches its entry) are removed until the total fits.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import asdict
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from boom_ml.specs import ModelSpec, StepSpec
from boom_ml.trace import repeat_enabled

if TYPE_CHECKING:
    from boom_ml.trace.graph import OpGraph

FORMAT = 1  # bump when the entry layout changes
# what builds and runs the traced model (peft, bitsandbytes: LoRA / QLoRA / 8-bit optimizers)
LIBRARIES = ("torch", "transformers", "timm", "torchvision", "peft", "bitsandbytes", "boom-ml")
DEFAULT_MAX_GIB = 2.0
_PACKAGE = Path(__file__).resolve().parent
_CODE_DIRS = (_PACKAGE / "trace", _PACKAGE / "zoo")
_MARKER = "meta.json"  # written last by OpGraph.save: its presence marks a complete entry


def default_root() -> Path:
    base = os.environ.get("BOOM_CACHE_DIR") or Path.home() / ".cache" / "boom_ml"
    return Path(base).expanduser() / "traces"


def default_max_bytes() -> int:
    return int(float(os.environ.get("BOOM_TRACE_CACHE_GB", DEFAULT_MAX_GIB)) * 2**30)


@cache
def library_versions() -> dict[str, str]:
    """Installed releases, read from package metadata (no import of the libraries)."""
    out = {}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


@cache
def code_digest() -> str:
    """Hash of the tracer's and zoo's sources, shipped configs and tables (the RNN reserve),
    plus TRACE_VERSION."""
    from boom_ml.trace import TRACE_VERSION  # the package's __init__ is torch-free

    digest = hashlib.sha256(f"trace_version={TRACE_VERSION}".encode())
    for folder in _CODE_DIRS:
        for path in sorted(p for p in folder.rglob("*") if p.suffix in (".py", ".json", ".csv")):
            digest.update(str(path.relative_to(_PACKAGE)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


# The most .py files beside a file model that its digest reads (a factory in a large folder)
MAX_SIBLINGS = 200


def _file_digest(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return "unreadable"


def model_source_digest(model: ModelSpec) -> str:
    """Digest of the user file a model is built from: a file model's source, an hf: local
    config, or the config.json a hub id resolves to in the local Hugging Face cache (a repo
    updated by ``hf download`` points its ref at a new snapshot); '' for names looked up in
    libraries and for shipped configs (in ``code_digest``)."""
    from boom_ml.hf_shipped import lookup, shipped_at_revision

    if model.scheme == "file":
        path = Path(model.name.rpartition(":")[0]).expanduser()
        # and the modules beside it, which a factory imports (a helper module's edited width
        # had been served the old graph; a hunt); a package elsewhere is not followed
        siblings = sorted(p for p in path.parent.glob("*.py") if p != path)[:MAX_SIBLINGS]
        digests = [_file_digest(path), *(f"{p.name}:{_file_digest(p)}" for p in siblings)]
        return hashlib.sha256("\n".join(digests).encode()).hexdigest()
    if model.scheme == "hf":
        path = Path(model.name).expanduser()
        if path.is_dir():
            path = path / "config.json"
        if path.is_file():
            return _file_digest(path)
        # a hub id, or a shipped id at a revision (gpt2@main: read from the hub cache too)
        at_revision = shipped_at_revision(model.name)
        if at_revision is not None or lookup(model.name) is None:
            from boom_ml.zoo import hf_hub  # a hub id: the zoo (and torch) load to trace it

            hub_id = hf_hub.looks_like_repo_id(model.name) or hf_hub.looks_like_bare_id(model.name)
            if at_revision is None and not hub_id:
                return ""
            cached = hf_hub.cached_config(at_revision or model.name)  # local only
            return _file_digest(cached) if cached is not None else ""
    return ""


def cache_key(model: ModelSpec, step: StepSpec) -> str:
    """The entry name of one (model, step) under the installed libraries and tracer."""
    doc = {
        "format": FORMAT,
        "model": model.text,
        "options": model.options,
        "model_source": model_source_digest(model),
        "step": asdict(step),
        "libraries": library_versions(),
        "code": code_digest(),
        "repeat_layers": repeat_enabled(),  # $BOOM_REPEAT_LAYERS=0 traces whole, cached apart
    }
    text = json.dumps(doc, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class TraceCache:
    """Traced OpGraphs on disk, least recently used evicted past ``max_bytes``."""

    def __init__(self, root: str | Path | None = None, max_bytes: int | None = None) -> None:
        self.root = Path(root) if root is not None else default_root()
        self.max_bytes = default_max_bytes() if max_bytes is None else int(max_bytes)

    def path(self, model: ModelSpec, step: StepSpec) -> Path:
        return self.root / cache_key(model, step)

    def get(self, model: ModelSpec, step: StepSpec) -> OpGraph | None:
        """The cached graph, or None; a hit becomes the most recently used entry."""
        from boom_ml.trace.graph import OpGraph

        entry = self.path(model, step)
        if not (entry / _MARKER).is_file():
            return None
        try:
            graph = OpGraph.load(entry)
        except Exception:  # noqa: BLE001 - a damaged entry is a miss, never an error
            shutil.rmtree(entry, ignore_errors=True)
            return None
        try:
            os.utime(entry)
        except OSError:
            pass  # a read-only cache still serves hits
        # trace_seconds stays the original trace's; this says it was not paid again
        graph.meta["from_cache"] = True
        return graph

    def put(self, model: ModelSpec, step: StepSpec, graph: OpGraph) -> Path | None:
        """Store ``graph``; returns its entry, or None when the cache cannot be written.

        Written to a temporary directory and renamed, so a reader (another process, or
        this one killed halfway) never sees half an entry.
        """
        entry = self.path(model, step)
        tmp = self.root / f".tmp-{entry.name}-{uuid.uuid4().hex[:8]}"
        try:
            graph.save(tmp)
            try:
                os.replace(tmp, entry)
            except OSError:
                # another process stored the same entry first: keep theirs
                shutil.rmtree(tmp, ignore_errors=True)
            self.evict()
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            return None
        return entry if entry.exists() else None

    def entries(self) -> list[tuple[float, int, Path]]:
        """(mtime, bytes, path) of each complete entry, oldest first."""
        out = []
        if not self.root.is_dir():
            return out
        for entry in self.root.iterdir():
            if entry.name.startswith(".") or not (entry / _MARKER).is_file():
                continue
            try:
                size = sum(f.stat().st_size for f in entry.iterdir())
                out.append((entry.stat().st_mtime, size, entry))
            except OSError:
                continue  # removed by another process meanwhile
        return sorted(out)

    def size_bytes(self) -> int:
        return sum(size for _, size, _ in self.entries())

    def evict(self) -> list[Path]:
        """Remove least recently used entries until the total is within ``max_bytes``."""
        entries = self.entries()
        total = sum(size for _, size, _ in entries)
        removed = []
        for _, size, entry in entries:
            if total <= self.max_bytes:
                break
            shutil.rmtree(entry, ignore_errors=True)
            total -= size
            removed.append(entry)
        return removed

    def clear(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
