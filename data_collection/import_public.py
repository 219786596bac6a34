"""Build the canonical datasets from the public sources under the shared data dir.

    python -m data_collection.import_public [--data-dir DIR] [--shared DIR] [--only SOURCE ...]

Writes ``<data-dir>/<kind>/<source>.parquet`` for kinds kernels, steps, memory and
op_profiles, validating every row; re-running rewrites identical files. Prints rows per
source and GPU, and every exclusion with its reason: nothing is dropped silently.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

import pandas as pd
from tqdm import tqdm

from data_collection import schema
from data_collection.importers import (
    cnn_step_times,
    deepbench,
    neusight,
    timm_bench,
    vidur,
    xmem,
)
from data_collection.importers.common import GpuResolver, ImportResult
from data_collection.paths import canonical_data_dir, shared_data_dir

IMPORTERS: dict[str, ModuleType] = {
    "neusight": neusight,
    "vidur": vidur,
    "deepbench": deepbench,
    "cnn_step_times": cnn_step_times,
    "timm_bench": timm_bench,
    "xmem": xmem,
}
# Dataset source names (the Parquet file stems) -> the importer that writes them.
SKIPPED = "(skipped non-NVIDIA)"
ALIASES = {
    "neusight_train": "neusight",
    "neusight_test": "neusight",
    "neusight_labels": "neusight",
    "timm": "timm_bench",
    "timm_train": "timm_bench",
    "timm_infer": "timm_bench",
    "memory": "xmem",
}


def _importers(only: Iterable[str] | None) -> list[str]:
    if not only:
        return list(IMPORTERS)
    chosen = []
    for name in only:
        key = ALIASES.get(name, name)
        if key not in IMPORTERS:
            choices = sorted({*IMPORTERS, *ALIASES})
            raise SystemExit(f"unknown source {name!r}; choose from: {', '.join(choices)}")
        if key not in chosen:
            chosen.append(key)
    return chosen


def _complete(df: pd.DataFrame, kind: str) -> pd.DataFrame:
    """Add the schema's columns an importer does not know (as null) in canonical order."""
    df = df.copy()
    for name in schema.columns(kind):
        if name not in df.columns:
            df[name] = None
    return df[schema.columns(kind)]


def import_all(
    shared_dir: str | Path | None = None,
    out_dir: str | Path | None = None,
    only: Iterable[str] | None = None,
    progress: bool = True,
) -> pd.DataFrame:
    """Run the importers and write the canonical datasets.

    Returns one row per (kind, source, gpu_id) with its row count; non-NVIDIA rows skipped
    because the GPU database lacks them appear with ``gpu_id`` ``SKIPPED``.
    """
    shared = Path(shared_dir) if shared_dir is not None else shared_data_dir()
    out = Path(out_dir) if out_dir is not None else canonical_data_dir()
    if not shared.is_dir():
        raise FileNotFoundError(f"shared data dir not found: {shared} (set BOOM_SHARED_DATA)")
    gpu = GpuResolver()
    counts: list[dict[str, object]] = []
    notes: list[str] = []
    for name in _importers(only):
        module = IMPORTERS[name]
        with tqdm(
            total=module.n_steps(shared), desc=name, disable=not progress, leave=False
        ) as bar:
            result: ImportResult = module.run(shared, gpu, lambda: bar.update(1))
        for (kind, source), frame in sorted(result.frames.items()):
            if frame.empty:
                raise ValueError(f"{name}: produced no {kind} rows for {source}")
            frame = _complete(frame, kind)
            schema.write_dataset(frame, kind, out / kind / f"{source}.parquet")
            for gpu_id, rows in frame.groupby("gpu_id").size().items():
                counts.append({"kind": kind, "source": source, "gpu_id": gpu_id, "rows": rows})
        for kind, rows in sorted(result.skipped_non_nvidia.items()):
            counts.append({"kind": kind, "source": name, "gpu_id": SKIPPED, "rows": rows})
            notes.append(f"{name}: skipped (non-NVIDIA, not in GPU database): {rows} {kind} rows")
        notes.extend(result.notes)
    table = pd.DataFrame(counts, columns=["kind", "source", "gpu_id", "rows"])
    table.attrs["notes"] = notes
    return table


def format_counts(table: pd.DataFrame) -> str:
    """Rows per GPU (lines) and dataset (columns), with totals."""
    kept = table[table["gpu_id"] != SKIPPED].copy()
    # A source that feeds two kinds (neusight_labels: steps and op_profiles) gets one column
    # per kind; other columns are named by source alone.
    kinds_per_source = kept.groupby("source")["kind"].nunique()
    shared = kept["source"].map(kinds_per_source) > 1
    kept["dataset"] = kept["source"].where(~shared, kept["source"] + "[" + kept["kind"] + "]")
    pivot = kept.pivot_table(
        index="gpu_id", columns="dataset", values="rows", aggfunc="sum", fill_value=0
    )
    pivot["TOTAL"] = pivot.sum(axis=1)
    pivot.loc["TOTAL"] = pivot.sum(axis=0)
    kinds = kept.groupby("dataset")["kind"].first()
    legend = ", ".join(f"{d}: {k}" for d, k in kinds.items())
    return f"rows per GPU and dataset ({legend})\n{pivot.to_string()}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="output dir (default: $BOOM_DATA_DIR or <repo>/data/canonical)",
    )
    parser.add_argument(
        "--shared",
        type=Path,
        default=None,
        help="public data dir (default: $BOOM_SHARED_DATA or <repo>/../shared/data)",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        default=None,
        metavar="SOURCE",
        help=f"importers to run: {', '.join(IMPORTERS)}",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    table = import_all(args.shared, args.data_dir, args.only, progress=not args.no_progress)
    out = args.data_dir or canonical_data_dir()
    print(format_counts(table))
    for note in table.attrs["notes"]:
        print(f"note: {note}")
    print(
        f"wrote {int(table.loc[table['gpu_id'] != SKIPPED, 'rows'].sum())} rows to {out} in {time.perf_counter() - start:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
