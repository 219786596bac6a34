"""The plot directory's check, torch- and matplotlib-free: the CLI runs it before the imports."""

from __future__ import annotations

import os
from pathlib import Path

from boom_ml.errors import InvalidInputError


def check_plot_path(directory: object) -> None:
    """``plot=`` names a directory: a path, not a number or a flag (the API takes any value)."""
    if not isinstance(directory, (str, os.PathLike)):
        raise InvalidInputError(f"plot must be a directory path, got {directory!r}")
    if not str(os.fspath(directory)).strip():  # plot= alone: Path("") is the current folder
        raise InvalidInputError("plot= needs a directory (plot=figures, plot=. for this one)")


def check_plot_dir(directory: str | Path) -> Path:
    """Create ``directory`` or fail with one clear line if it cannot be written."""
    check_plot_path(directory)
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise InvalidInputError(
            f"cannot create plot directory {str(path)!r}: {err.strerror}"
        ) from err
    if not os.access(path, os.W_OK):
        raise InvalidInputError(f"plot directory {str(path)!r} is not writable")
    return path
