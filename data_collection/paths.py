"""Where the public source data and the canonical datasets live.

The shared data sits beside the repository (``<repo>/../shared/data``) both here and in CI,
where the repository is cloned elsewhere with ``shared/`` next to it; the environment
variables exist so that a test or a user can point somewhere else without editing code.
"""

from __future__ import annotations

import os
from pathlib import Path

SHARED_ENV = "BOOM_SHARED_DATA"
DATA_DIR_ENV = "BOOM_DATA_DIR"


def repo_root() -> Path:
    """The repository root (the folder holding ``data_collection/``)."""
    return Path(__file__).resolve().parent.parent


def shared_data_dir() -> Path:
    """Public source data: ``$BOOM_SHARED_DATA`` if set, else ``<repo>/../shared/data``."""
    env = os.environ.get(SHARED_ENV)
    if env:
        return Path(env).expanduser().resolve()
    return (repo_root().parent / "shared" / "data").resolve()


def canonical_data_dir() -> Path:
    """Canonical Parquet datasets: ``$BOOM_DATA_DIR`` if set, else ``<repo>/data/canonical``."""
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        return Path(env).expanduser().resolve()
    return repo_root() / "data" / "canonical"


def measurements_dir() -> Path:
    """Our own GPU measurements, committed: ``<repo>/data_collection/measurements/<name>/``.

    Each ``<name>`` folder holds ``<kind>/<source>.parquet`` and a SOURCE.md. Hopper rows
    there are held out of training (``training/held_out.py``).
    """
    return repo_root() / "data_collection" / "measurements"
