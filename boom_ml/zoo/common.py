"""Helpers shared by the zoo's schemes: meta construction, losses, inputs, name matching."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from boom_ml.errors import BoomError, InvalidInputError, last_line

T = TypeVar("T")


WEIGHT_OPTIONS = ("weights", "weights_backbone", "pretrained", "pretrained_cfg_overlay")


def refuse_weights(options: dict[str, Any], what: str) -> None:
    """One line for a model option that asks for pretrained weights: models are built without
    them (their values change neither memory nor time), and a download would otherwise start
    (torchvision's ``weights_backbone=DEFAULT``: a traceback without network)."""
    for key in WEIGHT_OPTIONS:
        if options.get(key) not in (None, False):
            raise InvalidInputError(
                f"{what}: model_options.{key}={options[key]!r} asks for pretrained weights;"
                " models are built without them (values change neither memory nor time):"
                " drop it"
            )


def build_on_device(factory: Callable[[], T], device: str | torch.device = "meta") -> T:
    """Run ``factory`` so that every parameter and buffer it creates lands on ``device``.

    ``with torch.device("meta")`` is tried first: it never allocates. A few constructors
    read tensor *values* while building (torchvision's regnet computes widths with
    tensors), which meta cannot answer; for those the factory runs on the CPU with
    parameters and buffers moved to meta as they are registered, so at most one
    tensor is ever real at a time.
    """
    if torch.device(device).type != "meta":
        with torch.device(device):
            return factory()
    try:
        with torch.device("meta"):
            return factory()
    except Exception as first:
        if "meta" not in str(first).lower():
            raise  # a genuine error (bad option, bad config): report it unchanged
        try:
            with _register_on_meta():
                return factory()
        except Exception:
            raise first from None


def build_with_options(
    what: str, factory: Callable[[], T], device: str | torch.device = "meta"
) -> T:
    """:func:`build_on_device`, its failures one line each: a TypeError is an option the
    constructor does not take, anything else a value it cannot build with (num_classes=-5).
    A GPU's out-of-memory error stays one: a measurement records its build's OOM."""
    try:
        return build_on_device(factory, device)
    except TypeError as err:
        raise InvalidInputError(f"{what}: bad option: {err}") from err
    except (BoomError, torch.cuda.OutOfMemoryError):
        raise
    except Exception as err:  # noqa: BLE001 - see the docstring
        raise InvalidInputError(
            f"{what}: cannot build: {type(err).__name__}: {last_line(err)}"
        ) from err


@contextlib.contextmanager
def _register_on_meta() -> Iterator[None]:
    """Move parameters/buffers to meta as modules register them (cf. accelerate)."""
    old_param, old_buffer = nn.Module.register_parameter, nn.Module.register_buffer

    def register_parameter(self: nn.Module, name: str, param: Any) -> None:
        old_param(self, name, param)
        # Lazy modules' uninitialised parameters have no shape to move yet.
        if param is not None and not isinstance(param, nn.parameter.UninitializedParameter):
            p = self._parameters[name]
            self._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    def register_buffer(self: nn.Module, name: str, tensor: Any, persistent: bool = True) -> None:
        old_buffer(self, name, tensor, persistent)
        if tensor is not None:
            self._buffers[name] = self._buffers[name].to("meta")

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    nn.Module.register_buffer = register_buffer  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = old_param  # type: ignore[method-assign]
        nn.Module.register_buffer = old_buffer  # type: ignore[method-assign]


def ensure_meta(module: nn.Module) -> nn.Module:
    """Move stray real tensors (a factory that forced ``device="cpu"``) to meta."""
    if any(t.device.type != "meta" for t in [*module.parameters(), *module.buffers()]):
        module = module.to("meta")
    return module


def uncompiled(module: nn.Module) -> tuple[nn.Module, int]:
    """``module`` with every ``torch.compile`` wrapper (OptimizedModule), itself or a child,
    replaced by the module it wraps, and how many there were. The tracer records the eager
    ops a compiled module runs; the wrapper's forward takes only ``*args, **kwargs`` and
    would hide the wrapped module's signature and parameters' names."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:  # torch.compile imports it: nothing was compiled (and no import)
        return module, 0
    OptimizedModule = eval_frame.OptimizedModule  # noqa: N806 (the class's own name)
    count = 0
    while isinstance(module, OptimizedModule):
        module, count = module._orig_mod, count + 1
    for parent in list(module.modules()):
        # _modules, not named_children(): a child used twice (a shared block) is listed once
        # there, and its second place would keep the wrapper
        for name, child in list(parent._modules.items()):
            inner = child
            while isinstance(inner, OptimizedModule):
                inner, count = inner._orig_mod, count + 1
            if inner is not child:
                setattr(parent, name, inner)
    return module, count


def compiled_note(count: int) -> list[str]:
    """The note a model built with ``torch.compile`` carries (none when ``count`` is 0)."""
    if not count:
        return []
    return [
        f"torch.compile ({count} compiled module{'s' if count > 1 else ''}) traced as eager "
        "PyTorch: the kernels Inductor fuses are timed one by one and their intermediate "
        "tensors counted, so time and memory are eager mode's (usually higher)"
    ]


def own_dtype(module: nn.Module) -> str | None:
    """'bf16' or 'fp16' where every floating-point parameter of ``module`` is in it (a factory
    that returns ``model.to(torch.bfloat16)``), else None."""
    names = {torch.bfloat16: "bf16", torch.float16: "fp16"}
    found = {p.dtype for p in module.parameters() if p.is_floating_point()}
    return names.get(found.pop()) if len(found) == 1 else None


def own_dtype_note(info: dict[str, Any], params_dtype: str) -> list[str]:
    """The note a model built in 16 bits by its factory carries where the step names another
    ``params_dtype``: it is traced as built, and the name chooses how its time is predicted
    (a hunt: the same trace came out 4.96 ms as fp32 and 7.7 as bf16, without a word)."""
    own = info.get("own_dtype")
    if own is None or params_dtype != "fp32":  # a 16-bit params_dtype casts the model to it
        return []
    return [
        f"the factory's parameters are {own} and are traced as built; params_dtype={own} names "
        f"the step so (its time model and the header follow the name, params_dtype={params_dtype})"
    ]


def guess_family(module: nn.Module) -> str:
    """'transformer' if the model has attention layers, 'cnn' if it convolves, else 'other'."""
    kinds = {type(m).__name__.lower() for m in module.modules()}
    if any("attention" in k for k in kinds) or any(
        isinstance(m, nn.MultiheadAttention) for m in module.modules()
    ):
        return "transformer"
    if any(isinstance(m, nn.modules.conv._ConvNd) for m in module.modules()):
        return "cnn"
    return "other"


def floating_tensors(outputs: Any) -> list[torch.Tensor]:
    """Every floating-point tensor in a (possibly nested) model output."""
    if isinstance(outputs, torch.Tensor):
        return [outputs] if outputs.is_floating_point() else []
    if isinstance(outputs, dict):  # HF ModelOutput is an OrderedDict
        outputs = list(outputs.values())
    elif dataclasses.is_dataclass(outputs) and not isinstance(outputs, type):
        # a dataclass of outputs had been said to hold no tensor (a hunt)
        outputs = [getattr(outputs, f.name) for f in dataclasses.fields(outputs)]
    if isinstance(outputs, (list, tuple)):
        return [t for o in outputs for t in floating_tensors(o)]
    return []


def generic_loss(outputs: Any, inputs: dict[str, Any]) -> torch.Tensor:
    """A loss that touches every output: the sum of their means (in fp32, like a real loss)."""
    tensors = floating_tensors(outputs)
    if not tensors:
        raise InvalidInputError(
            "the model returned no floating-point tensor to compute a loss on (it returned "
            f"{type(outputs).__name__})"
        )
    return sum((t.float().mean() for t in tensors), torch.zeros((), device=tensors[0].device))


def classification_loss(outputs: Any, inputs: dict[str, Any]) -> torch.Tensor:
    """Cross-entropy on ``inputs["_labels"]``; auxiliary heads (Inception, GoogLeNet) weigh in.

    Inception v3 in train mode returns ``InceptionOutputs(logits, aux_logits)`` and
    GoogLeNet ``GoogLeNetOutputs(logits, aux_logits2, aux_logits1)``; their papers train
    on ``main + w * aux`` (w = 0.4 and 0.3), so the backward covers the aux branches.
    """
    labels = inputs["_labels"]
    if isinstance(outputs, torch.Tensor):
        return F.cross_entropy(outputs, labels)
    if isinstance(outputs, tuple) and hasattr(outputs, "_fields"):
        main = getattr(outputs, "logits", outputs[0])
        aux = [o for o in outputs[1:] if isinstance(o, torch.Tensor)]
        weight = 0.4 if len(aux) == 1 else 0.3
        loss = F.cross_entropy(main, labels)
        for a in aux:
            loss = loss + weight * F.cross_entropy(a, labels)
        return loss
    if isinstance(outputs, (list, tuple)) and outputs and isinstance(outputs[0], torch.Tensor):
        return F.cross_entropy(outputs[0], labels)
    return generic_loss(outputs, inputs)


def image_batch(
    batch_size: int, image_size: int, num_classes: int, device: torch.device, key: str = "x"
) -> dict[str, Any]:
    """``{key: images (B, 3, S, S) fp32, "_labels": classes (B,) int64}``; labels are loss-only."""
    return {
        key: torch.randn(batch_size, 3, image_size, image_size, device=device),
        "_labels": torch.randint(0, num_classes, (batch_size,), device=device),
    }


def closest(name: str, choices: list[str], n: int = 3) -> list[str]:
    """Up to ``n`` entries of ``choices`` closest to ``name`` (case-insensitive)."""
    import difflib

    lowered: dict[str, str] = {}
    for c in choices:
        lowered.setdefault(c.lower(), c)
    hits = difflib.get_close_matches(name.lower(), list(lowered), n=n, cutoff=0.5)
    return [lowered[h] for h in hits]


# What helps, for failures a model meets on fake CPU tensors: (exception type name or None for
# any, words in its message, the hint)
_USER_CODE_HINTS = (
    ("DataDependentOutputException", (),  # .item(), a branch on a value
     "the model reads a tensor's value: .item(), a branch on data, dynamic RoPE scaling; fake "
     "tensors have shapes, not values"),
    # a BatchNorm over a 1x1 map at batch 1 (deeplabv3's pooling branch; any CNN at a tiny
    # image): PyTorch refuses it in training on a GPU as here; after a global pool no image
    # size helps (a hunt had been told to try one at 1024 px)
    (None, ("expected more than 1 value per channel when training",),
     "a BatchNorm sees one value per channel: give batch_size >= 2; a larger image_size helps "
     "only a map made 1x1 by a small image, not one after a global pool, as in DeepLabV3's "
     "head"),
    (None, ("no nvidia driver", "not compiled with cuda", "cpu and cuda", "cuda and cpu"),
     "the model or its inputs ask for CUDA (.cuda(), .to('cuda'), device='cuda'); boom-ml "
     "traces on this machine, without a GPU, and gpu= names the GPU: build the model on the "
     "default device and make its inputs on example_inputs' device argument"),
    ("DynamicOutputShapeException", (),
     "an op whose output size depends on values (boolean-mask indexing, nonzero, "
     "pack_padded_sequence); fake tensors have shapes, not values: mask with masked_fill and "
     "an ignore_index, keep sequences padded"),
    (None, ("output size is too small", "kernel size can't be greater than actual input size"),
     "the input shrinks below a layer's kernel on its way through the model: give larger "
     "inputs (image_size, for an image model)"),
    (None, ("sparsetensorimpl",),
     "sparse gradients (nn.Embedding(sparse=True)) are not modelled: trace with sparse=False, "
     "whose dense gradient is what AdamW and most optimizers need anyway"),
)  # fmt: skip


def user_code_hint(err: BaseException) -> str:
    """' (what helps)' for a failure of a model's code we recognise, else ''."""
    said = str(err).lower()
    for name, words, hint in _USER_CODE_HINTS:
        if (name is None or type(err).__name__ == name) and (
            not words or any(w in said for w in words)
        ):
            return f" ({hint})"
    return ""
