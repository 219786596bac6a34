"""What the held-out kernel-row checks share (``size_floor_check``, ``anchor_check``,
``gemm_routing``): the columns a row is timed from, MAPE, their ``key=value`` arguments
(``gpus=[a,b]`` among them) and their entry point."""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection
from typing import Any

import numpy as np

# The columns a kernel row is featurised from: the rest (latency, versions, kernel names)
# would make every row distinct, and the size floor's copies with them.
ROW_COLUMNS = ["source", "op", "family", "dtype", "direction", "grad_wrt", "numel", "rows",
               "cols", "batch", "in_channels", "out_channels", "kernel_size", "kernel_w",
               "input_h", "input_w", "stride", "stride_w", "padding", "padding_w", "groups",
               "b", "m", "n", "k", "heads", "head_dim", "seq_q", "seq_kv"]  # fmt: skip


def mape(pred: np.ndarray, measured: np.ndarray) -> float:
    return float(100 * np.mean(np.abs(pred - measured) / measured))


def parse_arguments(argv: list[str], usage: str, keys: Collection[str]) -> dict[str, str]:
    """``key=value`` arguments of ``keys`` (anything else is one line naming ``usage``);
    ``gpus`` becomes a checked list (an unknown id is one line, not an empty table)."""
    from boom_ml.errors import InvalidInputError
    from boom_ml.gpus import get_gpu

    out: dict[str, str] = {}
    for arg in argv:
        key, _, value = arg.partition("=")
        if key not in keys:
            raise InvalidInputError(
                f"unknown argument {arg!r}: python -m {usage} (--help says what it does)"
            )
        out[key] = value
    for gpu in gpu_list(out.get("gpus")) or []:
        get_gpu(gpu)
    return out


def gpu_list(value: str | None) -> list[str] | None:
    """``[a,b]`` (or ``a,b``) as a list of ids; None when not given."""
    if value is None:
        return None
    return [g.strip() for g in value.strip("[]").split(",") if g.strip()]


def held_out_table(argv: list[str], usage: str, score: Callable[..., Any]) -> Any:
    """``score(kernels, models_for, gpus)`` on the training kernel rows, each GPU scored by its
    fold models (``training/fold_heads.py``), for a check whose one argument is ``gpus``."""
    from training.fold_heads import FoldHeads

    gpus = gpu_list(parse_arguments(argv, usage, ("gpus",)).get("gpus"))
    folds = FoldHeads.from_train_ops()
    return score(folds.kernels, folds.without, gpus)


def entry(doc: str | None, main: Callable[[list[str]], None]) -> None:
    """A check's ``__main__``: ``--help`` prints ``doc``; expected failures are one line."""
    from boom_ml.config_help import help_requested, one_line_errors

    if help_requested(sys.argv[1:]):
        print((doc or "").strip())
    else:
        with one_line_errors():
            main(sys.argv[1:])
