"""The software stack a training step runs on: PyTorch, CUDA and cuDNN releases and the
switches that change memory (module loading, cuDNN benchmark, allocator options).

Which stacks exist is a sourced, versioned table (``stacks.csv``: PyTorch's release
compatibility matrix). The default stack is the installed torch release with the CUDA
variant its wheel was built for (``+cu130`` → 13.0; a wheel without a CUDA tag is the
default variant of that release on PyPI) and PyTorch's own defaults for the switches.
A version the table does not know is a one-line error, never a silent default.

This module does not import torch: the installed release is read from package metadata.
"""

from __future__ import annotations

import csv
import re
from dataclasses import asdict, dataclass, replace
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

from boom_ml.errors import InvalidInputError
from boom_ml.specs import OPTIMIZER_IMPLS, bool_word

TABLE_PATH = Path(__file__).with_name("stacks.csv")
MODULE_LOADING = ("lazy", "eager")
# PyTorch sets CUDA_MODULE_LOADING=LAZY itself from 1.13 on (pytorch/pytorch#86509), and
# the driver honours it from CUDA 11.7 on; before either, every kernel image is loaded
# into the context when its library is loaded.
LAZY_FROM_TORCH = (1, 13)
LAZY_FROM_CUDA = (11, 7)
# The caching allocator's expandable_segments option was merged in April 2023, after 2.0
# (March 2023): pytorch/pytorch#99933 enables "expandable_segments, now merged from OSS",
# 2023-04-24; the first release that reads it is 2.1.
EXPANDABLE_FROM_TORCH = (2, 1)
# From 2.0 on, PyTorch's optimizers default to their foreach implementation when every
# parameter is a CUDA tensor (torch/optim/optimizer.py `_default_to_fused_or_foreach`);
# Adafactor opts out and runs its for-loop unless foreach=True is passed
# (torch/optim/_adafactor.py: "Adafactor will default to the slower single tensor
# for-loop implementation unless this flag is explicitly True").
FOREACH_DEFAULT_FROM_TORCH = (2, 0)
LOOP_BY_DEFAULT = ("adafactor",)
# Optimizers whose name fixes the implementation: bitsandbytes launches one fused kernel
# per tensor (recorded as the loop); adamw-fused is torch's fused AdamW.
FIXED_IMPL = {"adamw-fused": "fused", "adamw8bit": "loop", "paged-adamw8bit": "loop"}
FUSED_OPTIMIZERS = ("adam", "adamw", "sgd", "sgd-momentum", "sgd-nesterov", "adamw-fused")
# The first PyTorch release that has each (a stack of an earlier one cannot run it):
# torch.optim.Adafactor is new in 2.5 (PyTorch 2.5 release notes, "Add Adafactor"); the
# ``fused`` flag came to Adam in 1.13, to AdamW in 2.0 (both in torch.optim's docs of those
# releases, absent from the previous ones) and to SGD in 2.3 (pytorch/pytorch#116585,
# January 2024).
OPTIMIZER_FROM_TORCH = {"adafactor": (2, 5)}
FUSED_FROM_TORCH = {"adam": (1, 13), "adamw": (2, 0), "adamw-fused": (2, 0), "sgd": (2, 3),
                    "sgd-momentum": (2, 3), "sgd-nesterov": (2, 3)}  # fmt: skip


def version_tuple(text: str) -> tuple[int, ...]:
    """``"2.6.0+cu124"`` → (2, 6, 0); raises InvalidInputError on anything else."""
    m = re.fullmatch(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?(?:[.+].*)?", str(text).strip())
    if not m:
        raise InvalidInputError(f"not a version: {text!r} (expected e.g. 2.6 or 12.4)")
    return tuple(int(g) for g in m.groups() if g is not None)


def _minor(text: str) -> str:
    v = version_tuple(text)
    return f"{v[0]}.{v[1] if len(v) > 1 else 0}"


@dataclass(frozen=True)
class StackRow:
    torch: str  # minor release, e.g. "2.6"
    cuda: str  # e.g. "12.4"
    cudnn: str  # e.g. "9.1.0"
    default: bool  # the variant `pip install torch` gets on Linux
    source: str


@cache
def load_stacks(path: str | Path = TABLE_PATH) -> tuple[StackRow, ...]:
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(line for line in fh if not line.lstrip().startswith("#")))
    out = []
    for r in rows:
        if not r.get("source", "").strip():
            raise InvalidInputError(f"{path}: a row without a source ({r})")
        out.append(
            StackRow(
                torch=_minor(r["torch"]),
                cuda=_minor(r["cuda"]),
                cudnn=r["cudnn"].strip(),
                default=r["default"].strip().lower() == "true",
                source=r["source"].strip(),
            )
        )
    return tuple(out)


@dataclass(frozen=True)
class Stack:
    """One software stack. Every field is resolved (no None except ``max_split_size_mb``)."""

    torch: str
    cuda: str
    cudnn: str
    module_loading: str  # lazy | eager
    cudnn_benchmark: bool
    expandable_segments: bool
    max_split_size_mb: int | None
    source: str  # where the torch/CUDA/cuDNN combination comes from

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def default_optimizer_impl(self, optimizer: str) -> str:
        """The implementation PyTorch picks for ``optimizer`` when none is named."""
        if optimizer in FIXED_IMPL:
            return FIXED_IMPL[optimizer]
        if version_tuple(self.torch) < FOREACH_DEFAULT_FROM_TORCH or optimizer in LOOP_BY_DEFAULT:
            return "loop"
        return "foreach"


def installed_torch() -> tuple[str, str | None]:
    """(release, CUDA tag or None) of the installed torch, from package metadata."""
    try:
        text = metadata.version("torch")
    except metadata.PackageNotFoundError:  # pragma: no cover - torch is a dependency
        return "", None
    release, _, local = text.partition("+")
    return release, cuda_tag(local)


def cuda_tag(local: str) -> str | None:
    """The CUDA release of a torch wheel's local version tag (``cu124`` -> ``12.4``)."""
    m = re.fullmatch(r"cu(\d+)(\d)", local)
    return f"{m.group(1)}.{m.group(2)}" if m else None


def resolve_stack(options: dict[str, Any] | None = None) -> Stack:
    """The stack named by ``options`` (keys of ``stack.*``), defaults filled in.

    Missing ``torch``: the installed release. Missing ``cuda``: the CUDA tag of the
    installed wheel when torch is the installed one, else that release's default
    variant. Missing ``cudnn``: the one shipped with that torch/CUDA wheel.
    """
    opts = {k: v for k, v in (options or {}).items() if v is not None}
    unknown = set(opts) - {f for f in Stack.__dataclass_fields__ if f != "source"}
    if unknown:
        raise InvalidInputError(f"unknown stack option(s): {', '.join(sorted(unknown))}")
    for key in ("torch", "cuda", "cudnn"):
        if isinstance(opts.get(key), float):  # 2.10 as a Python float is 2.1
            raise InvalidInputError(
                f"stack.{key} must be a string such as '2.10' (a number reads 2.10 as"
                f" 2.1), got {opts[key]!r}"
            )
    tag = ""  # the CUDA tag of a pasted torch.__version__ (2.6.0+cu118)
    if "+" in str(opts.get("torch", "")):
        release, _, local = str(opts["torch"]).partition("+")
        tagged = cuda_tag(local)
        if tagged is None:
            raise InvalidInputError(
                f"stack.torch {opts['torch']!r}: '+{local}' is no CUDA wheel (a CUDA build's tag"
                " reads like +cu124)"
            )
        if "cuda" in opts and _minor(str(opts["cuda"])) != tagged:
            raise InvalidInputError(
                f"stack.torch {opts['torch']!r} is a CUDA {tagged} wheel; stack.cuda says "
                f"{opts['cuda']}"
            )
        opts, tag = {**opts, "torch": release, "cuda": tagged}, local
    rows = load_stacks()
    installed, installed_cuda = installed_torch()
    torch_given = "torch" in opts
    torch = _minor(str(opts.get("torch", installed)))
    known = sorted({r.torch for r in rows}, key=version_tuple)
    variants = [r for r in rows if r.torch == torch]
    if not variants:
        if torch_given:
            raise InvalidInputError(
                f"unknown stack.torch {opts['torch']!r}; known releases: {', '.join(known)}"
            )
        # an installed release newer than the table: its newest known row stands in
        variants = [r for r in rows if r.torch == known[-1]]
    default_row = next((r for r in variants if r.default), variants[0])
    row = default_row
    wanted = opts.get("cuda", None if torch_given else installed_cuda)
    if wanted is not None:
        match = [r for r in variants if r.cuda == _minor(str(wanted))]
        if not match and "cuda" in opts:
            asked = f" (its +{tag} tag)" if tag else ""
            raise InvalidInputError(
                f"torch {torch} was not released for CUDA {_minor(str(wanted))}{asked}; "
                f"its CUDA builds: {', '.join(r.cuda for r in variants)} (stack.cuda)"
            )
        row = match[0] if match else default_row
    cuda = row.cuda
    cudnn = str(opts.get("cudnn", row.cudnn))
    if "cudnn" in opts and cudnn not in {r.cudnn for r in rows}:
        raise InvalidInputError(
            f"unknown stack.cudnn {cudnn!r}; known: {', '.join(sorted({r.cudnn for r in rows}, key=version_tuple))}"
        )
    # a wheel links one cuDNN major (libcudnn.so.8 or .9): a newer minor of it can be
    # installed beside it, another major cannot be loaded
    if version_tuple(cudnn)[0] != version_tuple(row.cudnn)[0]:
        raise InvalidInputError(
            f"torch {torch} (CUDA {cuda}) is built against cuDNN {version_tuple(row.cudnn)[0]} "
            f"(its wheel ships {row.cudnn}); stack.cudnn={cudnn} is another major it cannot load"
        )
    lazy = version_tuple(torch) >= LAZY_FROM_TORCH and version_tuple(cuda) >= LAZY_FROM_CUDA
    loading = str(opts.get("module_loading", "lazy" if lazy else "eager"))
    if loading not in MODULE_LOADING:
        raise InvalidInputError(
            f"unknown stack.module_loading {loading!r}; choose one of: {', '.join(MODULE_LOADING)}"
        )
    if loading == "lazy" and version_tuple(cuda) < LAZY_FROM_CUDA:
        raise InvalidInputError(
            f"stack.module_loading=lazy needs CUDA >= 11.7 (the driver ignores "
            f"CUDA_MODULE_LOADING before it); this stack has CUDA {cuda}"
        )
    split = opts.get("max_split_size_mb")
    if split is not None and (isinstance(split, bool) or not isinstance(split, int) or split < 20):
        raise InvalidInputError(f"stack.max_split_size_mb must be an integer >= 20, got {split!r}")
    expandable = _bool("expandable_segments", opts.get("expandable_segments", False))
    if expandable and version_tuple(torch) < EXPANDABLE_FROM_TORCH:
        first = ".".join(map(str, EXPANDABLE_FROM_TORCH))
        raise InvalidInputError(
            f"stack.expandable_segments needs torch >= {first} (its allocator has no such "
            f"option in {torch})"
        )
    return Stack(
        torch=torch,
        cuda=cuda,
        cudnn=cudnn,
        module_loading=loading,
        cudnn_benchmark=_bool("cudnn_benchmark", opts.get("cudnn_benchmark", False)),
        expandable_segments=expandable,
        max_split_size_mb=split,
        source=row.source,
    )


ARCHS_PATH = Path(__file__).with_name("stack_archs.csv")


@cache
def _missing_rows() -> tuple[dict[str, str], ...]:
    with ARCHS_PATH.open(newline="") as fh:
        return tuple(csv.DictReader(line for line in fh if not line.startswith("#")))


def kernels_missing(stack: Stack, sm_version: int) -> str | None:
    """Why PyTorch's wheels of ``stack`` carry no kernels for a GPU of ``sm_version``
    (``stack_archs.csv``), or None when they do."""

    def within(value: str, low: str, high: str) -> bool:
        v = version_tuple(value)
        return (not low or v >= version_tuple(low)) and (not high or v <= version_tuple(high))

    for row in _missing_rows():
        if (
            int(row["sm_from"]) <= sm_version <= int(row["sm_to"])
            and within(stack.cuda, row["cuda_from"], row["cuda_to"])
            and within(stack.torch, row["torch_from"], row["torch_to"])
        ):
            return row["why"]
    return None


def running_variants(stack: Stack, sm_version: int) -> list[str]:
    """The CUDA variants of ``stack``'s torch release whose wheels do run on ``sm_version``."""
    return [
        r.cuda
        for r in load_stacks()
        if r.torch == stack.torch
        and kernels_missing(replace(stack, cuda=r.cuda), sm_version) is None
    ]


def stack_missing(stack: Stack, gpu: Any) -> str | None:
    """The note for a GPU (a GpuSpec) that ``stack``'s wheels cannot run on, else None."""
    why = kernels_missing(stack, gpu.sm_version)
    if why is None:
        return None
    others = running_variants(stack, gpu.sm_version)
    fix = (
        f"; torch {stack.torch} with CUDA {' or '.join(others)} runs there (stack.cuda={others[0]})"
        if others
        else ""
    )
    return (
        f"torch {stack.torch} + CUDA {stack.cuda} has no kernels for {gpu.id} "
        f"({why}), predicted as if it ran{fix}"
    )


def _bool(name: str, value: Any) -> bool:
    value = bool_word(value)
    if isinstance(value, bool):
        return value
    raise InvalidInputError(f"stack.{name} must be true or false, got {value!r}")


def resolve_optimizer_impl(optimizer: str, impl: str, stack: Stack) -> str:
    """``auto`` → what PyTorch of ``stack`` picks; ``fused`` only where PyTorch has it."""
    if impl not in OPTIMIZER_IMPLS:
        raise InvalidInputError(
            f"unknown optimizer.impl {impl!r}; choose one of: {', '.join(OPTIMIZER_IMPLS)}"
        )
    if optimizer == "none":
        return "none"
    since = OPTIMIZER_FROM_TORCH.get(optimizer)
    if since and version_tuple(stack.torch)[:2] < since:
        raise InvalidInputError(
            f"optimizer={optimizer} is new in PyTorch {'.'.join(map(str, since))}; "
            f"stack.torch={stack.torch} does not have it"
        )
    if impl == "auto":
        impl = stack.default_optimizer_impl(optimizer)
    fixed = FIXED_IMPL.get(optimizer)
    if fixed is not None and impl != fixed:  # the name says which kernels run
        raise InvalidInputError(
            f"optimizer {optimizer!r} runs only its {fixed} implementation; "
            f"drop optimizer.impl={impl} or pick another optimizer"
        )
    if impl == "fused" and optimizer not in FUSED_OPTIMIZERS:
        raise InvalidInputError(
            f"optimizer {optimizer!r} has no fused implementation in PyTorch; "
            f"fused exists for: {', '.join(FUSED_OPTIMIZERS)}"
        )
    since = FUSED_FROM_TORCH.get(optimizer)
    if impl == "fused" and since and version_tuple(stack.torch)[:2] < since:
        raise InvalidInputError(
            f"optimizer={optimizer} fused: PyTorch's fused kernel for it is new in "
            f"{'.'.join(map(str, since))}; stack.torch={stack.torch} does not have it"
            + ("" if optimizer == "adamw-fused" else " (use optimizer.impl=foreach)")
        )
    return impl


@cache
def default_stack() -> Stack:
    """The installed PyTorch's stack with its defaults (``resolve_stack()``, asked once)."""
    return resolve_stack()


def step_optimizer_impl(optimizer: str, impl: str, stack: Stack | None = None) -> str:
    """``optimizer_impl`` as a step records it: checked, ``auto`` resolved to what the
    stack's PyTorch picks (the installed one's without a stack), and left ``auto`` where the
    step has no optimizer. predict(), a Session and the tracer key and record steps so."""
    resolved = resolve_optimizer_impl(optimizer, impl, stack or default_stack())
    return "auto" if resolved == "none" else resolved
