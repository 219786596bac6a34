"""How a failure inside the user's model comes out of a trace: one line (a ``TraceError``),
without the traceback torch's fake-tensor logger would print first."""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterator

from boom_ml.errors import one_value_per_channel
from boom_ml.zoo.base import BuiltModel
from boom_ml.zoo.common import user_code_hint


@contextlib.contextmanager
def quiet_fake_tensor_log() -> Iterator[None]:
    """No traceback from torch's fake-tensor logger while tracing.

    When an op's meta kernel raises (a shape mismatch in the model), FakeTensorMode logs the
    whole traceback at ERROR level before re-raising; the trace turns the exception into a
    one-line TraceError, which the CLI prints alone.
    """
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def describe_failure(
    built: BuiltModel, exc: Exception, running: bool = True, image_size: int | None = None
) -> str:
    """One line for a failure inside the user's model: the exception's first line, the op it
    met (fake tensors name it), and what would help where we know it (``image_size``: the
    step's, where a model built for another may be why)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = text[:300]  # the hints below are kept whole
    op = getattr(exc, "func", None)
    where = f" in op {op}" if op is not None else ""
    module = _failing_module(built, exc)
    if module:
        where = f" in module {module}{where}"
    hook = getattr(exc, "boom_where", None)  # raised in the user's own hook (file_models.py)
    if hook:
        where = f" {hook}{where}"
    hint = user_code_hint(exc)  # the known failures' hints (zoo/common.py)
    aux = built.source == "torchvision" and "aux" in module.lower()
    if aux and "shrinks below" in hint:  # inception_v3 at 75 px
        hint = hint[:-1] + ", or leave out the auxiliary head: model_options.aux_logits=false)"
    text += hint or _other_size_hint(built, image_size)
    one_value = one_value_per_channel(exc)
    said = f"could not trace {built.spec.text}{where}: {type(exc).__name__}: {text}"
    synthesised = built.info.get("synthesised_input")
    if (
        synthesised and running and not hook and not one_value
    ):  # ``running``: the step failed, not a recipe's set-up (nor the user's loss, which its
        # outputs reach): a user's module given the one batch we can guess (file_models.py)
        said += (f" (its batch was synthesised as {synthesised} images; a model that takes other"
                 " inputs defines example_inputs(batch_size, device) on the module)")  # fmt: skip
    return said


def _failing_module(built: BuiltModel, exc: BaseException) -> str:
    """``name (Class)`` of the innermost submodule of the model whose method the exception
    passed through ('' for none, or the model itself): a shape mismatch in a large model had
    named the op alone (a hunt)."""
    names = {id(m): n for n, m in built.module.named_modules() if n}
    found = ""
    tb = exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if owner is not None and id(owner) in names:
            found = f"{names[id(owner)]} ({type(owner).__name__})"
        tb = tb.tb_next
    return found


# the keyword a vision model's constructor takes its image size by (timm's img_size, torchvision
# ViT's image_size, MaxViT's input_size: a pair)
_SIZE_KEYWORDS = ("img_size", "image_size", "input_size")


def _other_size_hint(built: BuiltModel, size: int | None) -> str:
    """Where a torchvision or timm model fails at an image size other than its own: the
    keyword its constructor builds another size with (a hunt: maxvit_t at 448, timm's mixer,
    LeViT and CoAtNet at 256 had stopped on a reshape's words alone)."""
    native = built.default_image_size
    if built.source not in ("timm", "torchvision") or not size or not native or size == native:
        return ""
    params: set[str] = set()
    for cls in type(built.module).__mro__:  # LeViT's distilled class passes **kwargs up
        with contextlib.suppress(TypeError, ValueError):
            params |= set(inspect.signature(cls.__init__).parameters)
    keyword = next((k for k in _SIZE_KEYWORDS if k in params), None)
    if keyword is None:
        return f" (it is built for {native}x{native} images: leave image_size out)"
    value = f"[{size},{size}]" if keyword == "input_size" else str(size)
    return (
        f" (it is built for {native}x{native} images; build it for {size} with"
        f" model_options={{{keyword}:{value}}}, where its architecture allows that size)"
    )
