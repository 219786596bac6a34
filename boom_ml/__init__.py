"""boom-ml: predict GPU memory and step time of a PyTorch training step, on any GPU.

import boom_ml
result = boom_ml.predict(model="hf:gpt2", gpu=["a100-80gb-sxm", "l4"], batch_size=8)
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # `boom_ml.predict` is both the CLI module (`python -m boom_ml.predict`) and the
    # Python API: the module is callable (see boom_ml/predict.py). Importing it lazily
    # keeps `python -m boom_ml.predict` from finding it half-imported.
    if name == "predict":
        return importlib.import_module("boom_ml.predict")
    if name == "Session":  # lazily too: the session imports torch
        return importlib.import_module("boom_ml.session").Session
    if name == "StepSpec":  # the step Session.evaluate takes
        return importlib.import_module("boom_ml.specs").StepSpec
    raise AttributeError(f"module 'boom_ml' has no attribute {name!r}")
