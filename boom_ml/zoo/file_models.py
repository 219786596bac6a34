"""``file:<path.py>:<factory>``: a user's own ``nn.Module``.

Protocol (all optional except the factory):

* ``factory(**options) -> nn.Module`` — called inside ``torch.device("meta")`` with the
  model spec's options as keyword arguments. Anything else it returns is an error.
* ``module.example_inputs(batch_size, device, **kw) -> dict | tuple | Tensor`` — the batch
  (a method of the returned module, else a function of that name in the file).
  A dict maps forward keyword names to tensors; keys starting with ``_`` are loss-only
  (labels). A tuple fills forward's first arguments in order; a bare tensor the first. If the method accepts them (or
  ``**kwargs``), ``seq_len=`` and ``image_size=`` from the step are passed too.
  Without this method, ``image_size`` must be given: the batch is one image tensor
  ``(batch, 3, image_size, image_size)`` for the first forward argument.
* ``module.loss(outputs, inputs) -> Tensor`` — the training loss (a method, else a function
  of the file); by default the sum of the
  means of every floating-point output tensor (every output receives a gradient).
* Checkpointing wraps the blocks found by :func:`boom_ml.zoo.checkpointing.find_blocks`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from boom_ml.errors import InvalidInputError, UnknownModelError, last_line
from boom_ml.specs import ModelSpec, StepSpec
from boom_ml.zoo.base import BuiltModel
from boom_ml.zoo.checkpointing import checkpoint_generic
from boom_ml.zoo.common import (
    build_on_device,
    compiled_note,
    ensure_meta,
    generic_loss,
    guess_family,
    own_dtype,
    uncompiled,
    user_code_hint,
)


def parse(name: str) -> tuple[Path, str]:
    """``path.py:factory`` -> (path, factory); the factory is after the *last* colon."""
    path, sep, factory = name.rpartition(":")
    if not sep or not path or not factory or factory.endswith(".py"):
        where = name if name.endswith(".py") else path or name
        raise UnknownModelError(
            f"file:{name} names no factory; write file:{where}:<function returning an nn.Module>"
            + _functions_hint(Path(where))
        )
    return Path(path).expanduser(), factory


def _functions_hint(path: Path) -> str:
    """' (functions in it: a, b)' from a cheap parse, without running the file."""
    import ast

    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return ""
    funcs = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    return f" (defined in it: {', '.join(funcs)})" if funcs else ""


def _import(path: Path, what: str) -> ModuleType:
    if not path.is_file():
        raise UnknownModelError(f"{what}: no such file {str(path)!r}")
    resolved = path.resolve()
    # A unique, stable module name per file: two user files both called model.py must not
    # collide, and registering it in sys.modules lets dataclasses/pickle inside it work.
    mod_name = "boom_user_" + hashlib.sha1(str(resolved).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(mod_name, resolved)
    if spec is None or spec.loader is None:
        raise InvalidInputError(f"{what}: cannot import {path} as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    # its own folder first on the import path while it is imported, as ``python model.py``
    # puts it: a project split into files (``from layers import block``) imports its siblings
    # from anywhere (a hunt). Then last (imports its functions make when called still find
    # them; a peft.py there does not shadow the installed peft), and its siblings are dropped
    # from sys.modules, so another folder's layers.py is its own.
    folder, before = str(resolved.parent), set(sys.modules)
    placed = folder not in sys.path  # a folder already on the path (the cwd) stays where it is
    if placed:
        sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as err:  # sys.exit() in it had ended the run without a word
        sys.modules.pop(mod_name, None)
        raise InvalidInputError(
            f"{what}: importing {path} raised {type(err).__name__}: {last_line(err)}"
        ) from err
    finally:
        if placed:
            sys.path.remove(folder)
            sys.path.append(folder)
        for name in set(sys.modules) - before - {mod_name}:
            if str(getattr(sys.modules[name], "__file__", "") or "").startswith(folder + os.sep):
                del sys.modules[name]
    return module


def _first_forward_arg(module: nn.Module) -> str:
    return _forward_args(module, 1)[0]


def _forward_args(module: nn.Module, count: int) -> list[str]:
    """The names of forward's first ``count`` arguments, which positional inputs fill."""
    params = [
        p
        for p in inspect.signature(module.forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    name = type(module).__name__
    if len(params) < count:
        raise InvalidInputError(
            f"{name}.forward takes {len(params)} named argument(s), not the {count} input(s) "
            "given: let example_inputs() return a dict {forward_arg: tensor}"
        )
    if any(p.kind is p.POSITIONAL_ONLY for p in params[:count]):
        raise InvalidInputError(
            f"{name}.forward's arguments are positional-only; "
            "define example_inputs() returning a dict of keyword arguments"
        )
    return [p.name for p in params[:count]]


def _call_example_inputs(fn: Any, step: StepSpec, dev: torch.device) -> Any:
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    extra = {
        k: v
        for k, v in (("seq_len", step.seq_len), ("image_size", step.image_size))
        if v is not None and (takes_any or k in params)
    }
    return fn(step.batch_size, dev, **extra)


def _sizes_read(fn: Any) -> frozenset[str] | None:
    """The step sizes ``example_inputs`` takes (None: it takes ``**kwargs``, so any)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    return frozenset(k for k in ("seq_len", "image_size") if k in params)


def _hook(module: nn.Module, user: ModuleType, name: str) -> Any:
    """``module.<name>`` if callable, else the file's function ``<name>``, else None."""
    for owner in (module, user):
        fn = getattr(owner, name, None)
        if callable(fn):
            return fn
    return None


def build(spec: ModelSpec, name: str, device: str | torch.device = "meta") -> BuiltModel:
    path, factory_name = parse(name)
    what = f"file:{name}"
    user = _import(path, what)
    factory = getattr(user, factory_name, None)
    if factory is None:
        raise UnknownModelError(
            f"{what}: {path} defines no {factory_name!r}" + _functions_hint(path)
        )
    if not callable(factory):
        raise InvalidInputError(f"{what}: {factory_name!r} is not callable")
    try:
        module = build_on_device(lambda: factory(**spec.options), device)
    except (Exception, SystemExit) as err:
        raise InvalidInputError(
            f"{what} raised {type(err).__name__}: {last_line(err)}{user_code_hint(err)}"
        ) from err
    if not isinstance(module, nn.Module):
        raise InvalidInputError(
            f"{what} returned {type(module).__name__}, expected a torch.nn.Module"
        )
    module, compiled = uncompiled(module)
    if torch.device(device).type == "meta":
        module = ensure_meta(module)

    # the module's own methods first, else functions of the file (README: "the module may
    # define" read both ways)
    example = _hook(module, user, "example_inputs")
    user_loss = _hook(module, user, "loss")
    has_example = example is not None
    input_name = None if has_example else _first_forward_arg(module)

    def make_inputs(step: StepSpec, dev: torch.device) -> dict[str, Any]:
        if has_example:
            # Called on the live module the tracer is using, so it may read its attributes.
            batch = _call_example_inputs(example, step, dev)
            if isinstance(batch, torch.Tensor):
                batch = {_first_forward_arg(module): batch}
            elif isinstance(batch, tuple) and batch:  # forward's positional inputs (a list
                # is one input: a detection model's list of images)
                batch = dict(zip(_forward_args(module, len(batch)), batch, strict=True))
            if not isinstance(batch, dict):
                raise InvalidInputError(
                    f"{what}: example_inputs returned {type(batch).__name__}; return a dict "
                    "{forward_arg: tensor} (keys starting with _ go to the loss only), a "
                    "tuple of forward's positional inputs, or one tensor"
                )
            return batch
        if step.image_size is None:
            raise InvalidInputError(
                f"{what}: cannot synthesise inputs; pass image_size for a (batch, 3, S, S) "
                "image input, or define example_inputs(batch_size, device) on the module or "
                "in the file"
            )
        s = step.image_size
        return {input_name: torch.randn(step.batch_size, 3, s, s, device=dev)}

    def compute_loss(outputs: Any, inputs: dict[str, Any]) -> torch.Tensor:
        if user_loss is None:
            try:
                return generic_loss(outputs, inputs)
            except InvalidInputError as err:  # the user's file can say which to train on
                raise InvalidInputError(
                    f"{err}; define loss(outputs, inputs) in {path.name} to say what it trains"
                ) from err
        try:
            loss = user_loss(outputs, inputs)
        except Exception as err:
            err.boom_where = "in its loss(outputs, inputs)"  # trace/failures.py names it
            raise
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            # autograd's own words were "grad can be implicitly created only for scalar outputs"
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            err = ValueError(f"it must return a scalar tensor, got {shape}")
            err.boom_where = "in its loss(outputs, inputs)"
            raise err
        return loss

    return BuiltModel(
        spec=spec,
        module=module,
        family=guess_family(module),
        make_inputs=make_inputs,
        compute_loss=compute_loss,
        enable_checkpointing=checkpoint_generic(what),
        reads=_sizes_read(example) if has_example else frozenset({"image_size"}),
        source="file",
        info={
            "name": name,
            "path": str(path),
            "factory": factory_name,
            "notes": compiled_note(compiled),
            "own_dtype": own_dtype(module),  # a 16-bit model: zoo/common.py's own_dtype_note
            # the batch the tracer makes without example_inputs: a failure names it (trace/failures.py)
            "synthesised_input": None if has_example else f"{input_name}=(batch, 3, S, S)",
        },  # fmt: skip
    )
