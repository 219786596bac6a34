"""Imports the command lines make lighter than a plain import would.

lightgbm imports scikit-learn whenever it is installed (mlflow installs it), for wrappers
boom-ml never uses (it calls ``lgb.train`` and ``lgb.Booster``): about 1 s of a 5 s
prediction, more than lightgbm itself. A command line is a process of its own, so it
imports lightgbm with scikit-learn hidden; the Python API leaves the user's process alone.
"""

from __future__ import annotations

import sys


def lightgbm_alone() -> None:
    """Import lightgbm without scikit-learn (its ``lightgbm.sklearn`` wrappers then say that
    scikit-learn is missing); nothing when either is imported already."""
    if "lightgbm" in sys.modules or "sklearn" in sys.modules:
        return
    sys.modules["sklearn"] = None  # type: ignore[assignment]  # import sklearn: ImportError
    try:
        import lightgbm  # noqa: F401
    finally:
        del sys.modules["sklearn"]
