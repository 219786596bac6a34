"""How a failure inside the user's model comes out of a trace: one line (a ``TraceError``),
without the traceback torch's fake-tensor logger would print first."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

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


def describe_failure(built: BuiltModel, exc: Exception, running: bool = True) -> str:
    """One line for a failure inside the user's model: the exception's first line, the op it
    met (fake tensors name it), and what would help where we know it."""
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
    if type(exc).__name__ == "DataDependentOutputException":  # .item(), a branch on a value
        text += (" (the model reads a tensor's value: .item(), a branch on data, dynamic RoPE"
                 " scaling; fake tensors have shapes, not values)")  # fmt: skip
    hint = user_code_hint(exc)
    if hint and "image_size" in hint and "aux" in module.lower():  # inception_v3 at 75 px
        hint = hint[:-1] + ", or leave out the auxiliary head: model_options.aux_logits=false)"
    text += hint
    one_value = text.startswith("Expected more than 1 value per channel when training")
    if one_value:
        # a BatchNorm over a 1x1 map (deeplabv3's pooling branch; any CNN at a tiny image):
        # PyTorch refuses it in training on a GPU as here (a hunt: no hint had followed)
        text += (" (a BatchNorm sees one value per channel: give batch_size >= 2, or a larger"
                 " image_size)")  # fmt: skip
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
