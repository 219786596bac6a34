"""Parquet shards for collection sweeps: atomic writes, a done-index, resume without duplicates.

A sweep writes many small shards under ``<root>/<kind>/`` instead of one file so that a job
killed at any moment loses at most the rows it had not flushed yet, and so that many jobs
(a Hydra multirun on Slurm) can write to one shared folder without coordinating: every
shard name carries the job id plus a random suffix, and no file is ever rewritten.

``root`` is a local path or any fsspec URL (``s3://bucket/x``, ``gs://...``, ``file:///...``).
A shard is written to ``.<name>.tmp`` first and renamed: readers only look at
``*.parquet``, so they never see half a file, and a crash leaves at most a stray ``.tmp``.

Every shard row carries ``config_key``, a stable hash of the configuration that produced
it. It is not part of the canonical schemas (:mod:`data_collection.schema`); it is what
lets a rerun skip configurations that are already on disk, and :func:`read_shards` /
:func:`merge_shards` drop it when the shards become a canonical dataset. Other extra
columns a harness needs (``phase``, ``module``, ``family`` of op-profile rows) are kept in
the shards and dropped the same way.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm.auto import tqdm

from data_collection import schema

log = logging.getLogger(__name__)

KEY = "config_key"


def config_key(config: Mapping[str, Any]) -> str:
    """A stable 16-hex-digit hash of a config dict (key order and int/float spelling aside).

    JSON with sorted keys is the canonical text, so the same config gives the same key in
    every process, Python version and machine — which is what resume across jobs needs.
    """
    text = json.dumps(_plain(config), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def _plain(value: Any) -> Any:
    """Turn OmegaConf containers, tuples and numpy scalars into plain JSON-able values."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        return value.item()
    return value


def _fs(root: str | Path) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, path = fsspec.core.url_to_fs(str(root))
    return fs, path.rstrip("/")


def shard_files(root: str | Path, kind: str) -> list[str]:
    """Finished shard paths (``*.parquet``, never ``*.tmp``) of ``kind`` under ``root``."""
    fs, base = _fs(root)
    folder = f"{base}/{kind}"
    if not fs.exists(folder):
        return []
    return sorted(
        p for p in fs.glob(f"{folder}/*.parquet") if not p.rsplit("/", 1)[-1].startswith(".")
    )


def done_keys(root: str | Path, kind: str) -> set[str]:
    """Config keys already written for ``kind`` (reads only the key column of each shard)."""
    fs, _ = _fs(root)
    keys: set[str] = set()
    for path in shard_files(root, kind):
        with fs.open(path, "rb") as fh:
            keys.update(pq.read_table(fh, columns=[KEY]).column(KEY).to_pylist())
    return keys


def read_shards(root: str | Path, kind: str, keep_extra: bool = False) -> pd.DataFrame:
    """All shard rows of ``kind``; canonical columns only unless ``keep_extra``."""
    fs, _ = _fs(root)
    frames = []
    for path in shard_files(root, kind):
        with fs.open(path, "rb") as fh:
            frames.append(pq.read_table(fh).to_pandas())
    if not frames:
        return pd.DataFrame(columns=schema.columns(kind) + ([KEY] if keep_extra else []))
    df = pd.concat(frames, ignore_index=True)
    return df if keep_extra else df[schema.columns(kind)]


def merge_shards(root: str | Path, kind: str, out_path: str | Path) -> int:
    """Validate all shards of ``kind`` and write one canonical Parquet file; returns rows.

    Rows are de-duplicated by ``config_key`` (plus node index for op profiles) as a last
    guard, although the writer already never writes a key twice.
    """
    df = _deduplicated(root, kind)
    return schema.write_dataset(df[schema.columns(kind)], kind, out_path)


def _deduplicated(root: str | Path, kind: str) -> pd.DataFrame:
    """Every shard row of ``kind`` once (by config key, plus node index for op profiles)."""
    df = read_shards(root, kind, keep_extra=True)
    subset = [KEY, "node_index"] if kind == "op_profiles" else [KEY]
    return df.drop_duplicates(subset=subset, keep="first")


def merge_by_source(root: str | Path, out_dir: str | Path) -> dict[str, int]:
    """Every kind's shards under ``root`` as ``out_dir/<kind>/<source>.parquet``; rows per file.

    A sweep plan writes several sources into one shard folder (the H200 plan: NeuSight steps,
    AMP steps, two kernel sweeps); this is how its archive becomes committed datasets. The
    run's ``environment.json`` (GPU, driver, library versions, date: what the folder's
    SOURCE.md states) is copied beside them.
    """
    written: dict[str, int] = {}
    environment = Path(root) / "environment.json"
    if environment.is_file():
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "environment.json").write_text(environment.read_text())
    for kind in schema.KINDS:
        df = _deduplicated(root, kind)
        for source, rows in df.groupby("source", sort=True):
            path = Path(out_dir) / kind / f"{source}.parquet"
            path.parent.mkdir(parents=True, exist_ok=True)
            written[f"{kind}/{source}"] = schema.write_dataset(
                rows[schema.columns(kind)], kind, path
            )
    return written


class ShardWriter:
    """Buffers rows of one dataset ``kind`` and writes them as atomic Parquet shards.

    ``add(key, rows)`` takes every row a configuration produced (one kernel or step row,
    or the many op-profile rows of one step) so a key is either entirely on disk or not at
    all. Keys already on disk when the writer opened, or added before, are ignored: a
    resumed sweep can therefore never duplicate a configuration, even if it crashed
    between writing two kinds of rows for the same key.
    """

    def __init__(
        self, root: str | Path, kind: str, job_id: str, flush_every: int | None = 50
    ) -> None:
        schema.columns(kind)  # fail fast on an unknown kind
        self.root, self.kind, self.job_id = str(root), kind, _safe(job_id)
        # None: the caller flushes (a sweep writing two kinds flushes them in a set order).
        self.flush_every = max(1, int(flush_every)) if flush_every else None
        self.fs, base = _fs(root)
        self.folder = f"{base}/{kind}"
        self.fs.makedirs(self.folder, exist_ok=True)
        self.done: set[str] = done_keys(root, kind)
        self._rows: list[dict[str, Any]] = []
        self._keys: list[str] = []
        self._seq = 0
        self.written = 0  # rows written by this writer
        self.files: list[str] = []

    def is_done(self, key: str) -> bool:
        return key in self.done

    def add(self, key: str, rows: Iterable[Mapping[str, Any]]) -> bool:
        """Queue ``rows`` for ``key``; False (nothing queued) when the key is already done."""
        if key in self.done:
            return False
        batch = [{**row, KEY: key} for row in rows]
        self.done.add(key)
        self._rows.extend(batch)
        self._keys.append(key)
        if self.flush_every and len(self._keys) >= self.flush_every:
            self.flush()
        return True

    def flush(self) -> str | None:
        """Write queued rows as one shard (validated against the schema); returns its path.

        A configuration whose rows fail validation is dropped (logged, and left undone so a
        fixed harness measures it again) instead of failing the whole batch: a bug in one
        row builder must not cost a GPU sweep the rows of every other configuration.
        """
        if not self._rows:
            return None
        rows = self._rows
        try:
            table = self._table(rows)
        except schema.SchemaError:
            rows = self._valid_rows()
            table = self._table(rows) if rows else None
        self._rows, self._keys = [], []
        if table is None:
            return None
        name = f"{self.kind}-{self.job_id}-{time.strftime('%Y%m%dT%H%M%S')}-{self._seq:04d}-{uuid.uuid4().hex[:6]}.parquet"
        final, tmp = f"{self.folder}/{name}", f"{self.folder}/.{name}.tmp"
        with self.fs.open(tmp, "wb") as fh:
            pq.write_table(table, fh, compression="zstd")
        # A rename on a filesystem; on object stores the final object appears whole too.
        self.fs.mv(tmp, final)
        self._seq += 1
        self.written += table.num_rows
        self.files.append(final)
        log.info("wrote %d %s rows to %s", table.num_rows, self.kind, final)
        return final

    def _table(self, rows: list[dict[str, Any]]) -> pa.Table:
        """Validated Arrow table of ``rows``: canonical schema plus harness-only columns."""
        df = pd.DataFrame(rows)
        names = schema.columns(self.kind)
        valid = schema.validate(df[names], self.kind, origin=f"{self.kind} shard of {self.job_id}")
        table = pa.Table.from_pandas(
            valid, schema=schema.arrow_schema(self.kind), preserve_index=False
        )
        for col in (c for c in df.columns if c not in names):
            table = table.append_column(col, pa.array(df[col].tolist(), from_pandas=True))
        return table

    def _valid_rows(self) -> list[dict[str, Any]]:
        """The queued rows of every key whose rows validate; the others are logged."""
        keep: list[dict[str, Any]] = []
        for key in self._keys:
            rows = [r for r in self._rows if r[KEY] == key]
            try:
                self._table(rows)
                keep.extend(rows)
            except schema.SchemaError as err:
                log.error("dropping %s rows of config %s: %s", self.kind, key, err)
                self.done.discard(key)
        return keep

    @property
    def pending(self) -> int:
        """Configurations queued but not yet on disk."""
        return len(self._keys)

    def discard(self) -> None:
        """Drop queued rows (a simulated crash: they were never on disk)."""
        for key in self._keys:
            self.done.discard(key)
        self._rows, self._keys = [], []

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.flush()


def _safe(text: str) -> str:
    """A job id fit for a file name on any filesystem or object store."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in str(text)) or "job"


class SimulatedCrash(RuntimeError):
    """Raised by ``fail_after``: the sweep dies as if killed, unflushed rows are lost."""


@dataclass
class SweepStats:
    total: int = 0  # configurations in this job's part of the sweep
    already_done: int = 0  # skipped because their key was on disk when the job started
    measured: int = 0
    skipped: int = 0  # the harness could not measure them (unsupported on this device)
    stopped_by_budget: bool = False
    files: list[str] = field(default_factory=list)


Measure = Callable[[dict[str, Any]], dict[str, list[dict[str, Any]]]]


def my_share(key: str, num_shards: int, shard_index: int) -> bool:
    """Whether this job of a ``num_shards``-way fan-out owns ``key`` (hash partition)."""
    return num_shards <= 1 or int(key, 16) % num_shards == shard_index


def run_configs(
    configs: Sequence[tuple[str, dict[str, Any]]],
    writers: dict[str, ShardWriter],
    primary: str,
    measure: Measure,
    *,
    flush_every: int = 50,
    time_budget_s: float | None = None,
    fail_after: int | None = None,
    desc: str = "sweep",
) -> SweepStats:
    """Measure every ``(key, config)`` not done yet and write its rows; the sweep's loop.

    ``measure(config)`` returns rows per dataset kind (``{}`` when the configuration cannot
    run here). A key counts as done when it is in the ``primary`` writer's shards, so the
    other kinds are always flushed first: a kill between two flushes can leave rows of a
    secondary kind whose primary row is missing (the rerun measures the key again and the
    secondary writer ignores the duplicate), never the reverse, which would lose them.
    The time budget stops *launching* configurations; the one running finishes and
    everything measured is flushed.
    """
    stats = SweepStats(total=len(configs))
    done = writers[primary].done
    todo = [(k, c) for k, c in configs if k not in done]
    stats.already_done = len(configs) - len(todo)
    started = time.monotonic()
    order = [k for k in writers if k != primary] + [primary]

    def flush_all() -> None:
        for kind in order:
            path = writers[kind].flush()
            if path:
                stats.files.append(path)

    bar = tqdm(todo, desc=desc, unit="cfg", mininterval=2.0, dynamic_ncols=True)
    try:
        for key, config in bar:
            if time_budget_s is not None and time.monotonic() - started > time_budget_s:
                stats.stopped_by_budget = True
                log.warning("%s: time budget of %.0f s reached, stopping", desc, time_budget_s)
                break
            rows = measure(config)
            if not rows.get(primary):
                stats.skipped += 1
                continue
            for kind in order:
                if rows.get(kind):
                    writers[kind].add(key, rows[kind])
            stats.measured += 1
            if fail_after is not None and stats.measured >= fail_after:
                for writer in writers.values():
                    writer.discard()
                raise SimulatedCrash(f"{desc}: simulated crash after {stats.measured} configs")
            if writers[primary].pending >= flush_every:
                flush_all()
    except SimulatedCrash:
        raise
    except BaseException:
        flush_all()  # a real error or Ctrl-C: what was measured is still good data
        raise
    finally:
        bar.close()
    flush_all()
    return stats


def hydra_entry(config_name: str, task: Any) -> None:
    """Run ``task`` as the Hydra main of ``configs/<config_name>.yaml`` (sweep entry points).

    Hydra is imported here, not at module level, so the plain sweep functions run where only
    torch is installed (the GPU machine's image has no hydra-core).
    """
    import sys
    import warnings

    import hydra

    from boom_ml.config_help import CONFIG_DIR, print_help_if_asked

    if print_help_if_asked(sys.modules[task.__module__].__doc__, config_name):
        return

    # configs/hydra/launcher/submitit_*.yaml deliberately share the plugin's names (they are
    # the documented `hydra/launcher=submitit_local|slurm` choices); Hydra warns about it.
    warnings.filterwarnings("ignore", message=".*validated against ConfigStore schema.*")
    hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name=config_name)(task)()
