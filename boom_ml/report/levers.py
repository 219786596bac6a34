"""The advisor's levers: the changes it offers a step that does not fit, alone
(:func:`single_changes`), stacked (:func:`stacked_changes`) and as fine-tuning recipes
(:func:`recipe_changes`), each as (label, changed step, accumulation steps).

The levers: autocast, activation checkpointing, an optimizer with less state, 16-bit frozen
weights for LoRA, and a smaller micro-batch with gradient accumulation (same effective batch;
the gradients stay alive between micro-batches, which the memory replay models). Stacked, they
go in roughly the order of what they cost in speed; the splits go on top of them all.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import replace
from typing import Any

from boom_ml.errors import InvalidInputError
from boom_ml.gpus.spec import GpuSpec
from boom_ml.specs import StepSpec

# The optimizer to suggest instead, and why it needs less memory.
LIGHTER_OPTIMIZER = {
    "adam": ("adafactor", "Adafactor keeps factored second moments, no first moment"),
    "adamw": ("adafactor", "Adafactor keeps factored second moments, no first moment"),
    "adagrad": ("adafactor", "Adafactor keeps factored second moments"),
    "rmsprop": ("sgd", "SGD keeps no optimizer state"),
    "sgd-momentum": ("sgd", "SGD without momentum keeps no optimizer state"),
}


def _amp_for(gpu: GpuSpec) -> str:
    return "bf16" if gpu.bf16_tflops else "fp16"


def _autocast_applies(step: StepSpec) -> bool:
    """Autocast halves fp32 weights' activations; 16-bit parameters already compute in 16
    bits (and an fp16 GradScaler cannot unscale fp16 gradients)."""
    return step.amp == "none" and step.params_dtype == "fp32"


def split_change(step: StepSpec, micro: int) -> tuple[str, StepSpec, int]:
    """``step`` run as micro-batches of ``micro`` samples: (label, changed step, accumulation)."""
    accumulation = step.batch_size // micro
    steps = step.grad_accum * accumulation
    return _split(micro, steps), replace(step, batch_size=micro, grad_accum=steps), accumulation


def single_changes(step: StepSpec, gpu: GpuSpec) -> list[tuple[str, StepSpec, int]]:
    """(label, changed step, accumulation) for every lever still available."""
    out: list[tuple[str, StepSpec, int]] = []
    if _autocast_applies(step):
        amp = _amp_for(gpu)
        out.append((f"amp={amp}", replace(step, amp=amp), 1))
    if _fp16_for_bf16(step, gpu):
        out.append(("amp=fp16 (no bf16 tensor cores on this GPU)", replace(step, amp="fp16"), 1))
    if halves_frozen_weights(step):
        dtype = _amp_for(gpu)
        out.append((f"params_dtype={dtype} (frozen weights in 16 bits)",
                    replace(step, params_dtype=dtype), 1))  # fmt: skip
    if step.checkpointing != "full" or step.checkpointing_every > 1:
        # from none, selective or every K-th block: every block's activations recomputed
        label = "checkpointing=full" if step.checkpointing != "full" else "checkpointing.every=1"
        if step.checkpointing != "full" and step.checkpointing_every > 1:
            label += " + checkpointing.every=1"
        out.append((label, replace(step, checkpointing="full", checkpointing_every=1), 1))
    if step.optimizer in LIGHTER_OPTIMIZER and step.finetune_method == "full":
        # (adapters' optimizer state is a few MiB: a lighter optimizer saves nothing)
        name, why = LIGHTER_OPTIMIZER[step.optimizer]
        # its own implementation (the step's was resolved for the optimizer it replaces:
        # Adafactor traced with AdamW's foreach temporaries came out 4 GB too large)
        lighter = replace(step, optimizer=name, optimizer_impl="auto")
        out.append((f"optimizer={name} ({why})", lighter, 1))
    # up to 8 micro-batches; a batch with no such split (a prime above 8) runs one at a time
    micros = halving_micros(step.batch_size)
    for micro in [m for m in micros if step.batch_size // m <= 8] or micros[-1:]:
        out.append(split_change(step, micro))
    return out


def half_precision_splits(
    step: StepSpec, gpu: GpuSpec, fitted: int
) -> list[tuple[str, StepSpec, int]]:
    """Autocast, and a LoRA step's frozen weights in 16 bits, each on top of the largest
    micro-batch split that fitted alone (``fitted`` samples) and of the next larger one: where
    the lever alone does not fit, the pair can still be much faster than the split (resnet152
    at 256 on a T4: 128 x 2 in fp16 at half the time of 64 x 4 in fp32; Llama-3.2-1B LoRA at
    8 x 1024 on an RTX 3080: 2 x 4 on bf16 frozen weights 24 % faster than 1 x 8, which had
    been the one advice: a hunt), and the stacked walk, which runs only where no lever fits
    alone, never asks it."""
    levers = []
    if _autocast_applies(step):
        levers.append((f"amp={_amp_for(gpu)}", replace(step, amp=_amp_for(gpu))))
    elif _fp16_for_bf16(step, gpu):  # bf16 where no tensor core takes it (a hunt: a T4's)
        levers.append(("amp=fp16", replace(step, amp="fp16")))
    if halves_frozen_weights(step):
        dtype = _amp_for(gpu)
        levers.append((f"params_dtype={dtype}", replace(step, params_dtype=dtype)))
    out = []
    for lever, changed in levers:
        for micro in halving_micros(step.batch_size):
            if micro in (fitted, 2 * fitted):
                label, split, accumulation = split_change(changed, micro)
                out.append((f"{lever} + {label}", split, accumulation))
    return out


def _fp16_for_bf16(step: StepSpec, gpu: GpuSpec) -> bool:
    """Whether the advice offers fp16 autocast in place of bf16's: bf16 runs at the fp32 rate
    where no tensor core takes it, and SDPA has no fused bf16 kernel there (its math path
    holds each attention matrix); fp16 halves the same bytes on tensor cores, where
    GradScaler can unscale the gradients (not fp16 ones: params_dtype=fp16)."""
    if step.amp != "bf16" or gpu.bf16_tensor_cores:
        return False
    try:
        replace(step, amp="fp16")
    except InvalidInputError:
        return False
    return True


def _split(micro: int, steps: int) -> str:
    """A micro-batch split as the advice prints it (``batch_size=4 x 2 accumulation steps``;
    the keys that run it, ``batch_size=4 grad_accum=2``, are the advice's ``options``)."""
    return f"batch_size={micro} x {steps} accumulation steps"


def halves_frozen_weights(step: StepSpec) -> bool:
    """Whether the advice offers a LoRA step its frozen fp32 weights in 16 bits: how LoRA is
    run (they take no update, so rounding them loses nothing), half their bytes; not under
    fp16 autocast with adapters in the weights' dtype (GradScaler cannot unscale fp16
    adapter gradients; peft's default fp32 adapters it can)."""
    scaled = step.amp == "fp16" and step.adapter_dtype == "params"
    return step.finetune_method == "lora" and step.params_dtype == "fp32" and not scaled


def halving_micros(batch: int) -> list[int]:
    """Micro-batch sizes about halving from ``batch`` down to 1, each dividing it exactly
    (the largest divisor at or below each half): a split that does not (5 as 2 x 2) trains
    fewer samples per step and looks faster for it."""
    every = divisors(batch)
    out: list[int] = []
    target = batch
    while target > 1:
        target //= 2
        micro = every[bisect.bisect_right(every, target) - 1]
        if micro not in out:
            out.append(micro)
    return out


def divisors(batch: int) -> list[int]:
    """Every divisor of ``batch``, ascending (trial division to its square root)."""
    small = [d for d in range(1, math.isqrt(batch) + 1) if batch % d == 0]
    return sorted({*small, *(batch // d for d in small)})


def changes_checkpointing(step: StepSpec, changed: StepSpec) -> bool:
    """Whether ``changed`` checkpoints the step's activations otherwise (the lever)."""
    return (changed.checkpointing, changed.checkpointing_every) != (
        step.checkpointing,
        step.checkpointing_every,
    )


def stacked_changes(
    step: StepSpec, gpu: GpuSpec, checkpointing: bool = True
) -> list[tuple[str, StepSpec, int]]:
    """Levers applied one on top of the other, cheapest first, the micro-batch splits on top
    of them all; without ``checkpointing``, every lever but activation checkpointing."""
    out: list[tuple[str, StepSpec, int]] = []
    labels: list[str] = []
    current, accumulation = step, 1
    for label, changed, acc in single_changes(step, gpu):
        if acc > 1:  # only the smallest micro-batch still needed is stacked, below
            continue
        if not checkpointing and changes_checkpointing(step, changed):
            continue
        diff = step_diff(step, changed)
        if diff.get("params_dtype", "fp32") != "fp32" and current.amp != step.amp:
            # 16-bit parameters compute in 16 bits: the autocast stacked before them goes
            # (fp16 weights under fp16 autocast cannot even be unscaled)
            diff["amp"] = step.amp
            labels = [x for x in labels if not x.startswith("amp=")]
        try:
            stacked = replace(current, **diff)
        except InvalidInputError:  # levers that cannot stack
            continue
        current = stacked
        labels.append(label.split(" (")[0])
        if len(labels) > 1:
            out.append((" + ".join(labels), current, accumulation))
    for micro in halving_micros(step.batch_size):
        accumulation = step.batch_size // micro
        out.append(
            (
                " + ".join([*labels, _split(micro, step.grad_accum * accumulation)]),
                replace(current, batch_size=micro, grad_accum=step.grad_accum * accumulation),
                accumulation,
            )
        )
    return out


# Fine-tuning recipes in levels of falling memory, each tried only on the GPUs where no
# earlier level fits (every candidate is a trace per attention group: an 8B model's cost
# seconds each): LoRA; then QLoRA, or LoRA at one sample per micro-batch; then QLoRA so.
RECIPE_LEVELS = ((("lora", False),), (("qlora", False), ("lora", True)), (("qlora", True),))
# Training every weight in bf16 ("bf16-true"), tried apart from the adapters' levels: with the
# step's optimizer, then (where that does not fit) with the lighter one
BF16_TRUE_LEVELS = (False, True)
BF16_TRUE = "bf16-true: weights, gradients and optimizer state in bf16, no fp32 master copy"


def bf16_true_changes(
    step: StepSpec, gpu: GpuSpec, lighter: bool = False
) -> list[tuple[str, StepSpec, int]]:
    """Every weight trained in bf16 without autocast or an fp32 master copy (Lightning's
    ``precision="bf16-true"``), with activation checkpointing; ``lighter``: and the lighter
    optimizer. Half the bytes of the parameters, their gradients and (for most optimizers)
    their state, at the cost of bf16's rounding in the update: a recipe, listed apart from
    the levers. A full fp32 step on a GPU with bf16 tensor cores only (fp16 without a master
    copy underflows its updates)."""
    if not (gpu.bf16_tflops and step.finetune_method == "full" and step.params_dtype == "fp32"):
        return []
    if lighter and step.optimizer not in LIGHTER_OPTIMIZER:
        return []
    changed = replace(step, params_dtype="bf16", amp="none", master_weights=False,
                      checkpointing="full", checkpointing_every=1)  # fmt: skip
    if lighter:
        changed = replace(changed, optimizer=LIGHTER_OPTIMIZER[step.optimizer][0],
                          optimizer_impl="auto")  # fmt: skip
    return [(" + ".join(_changed_keys(step, changed)), changed, 1)]


def recipe_changes(
    step: StepSpec, gpu: GpuSpec, level: tuple[tuple[str, bool], ...] = RECIPE_LEVELS[0]
) -> list[tuple[str, StepSpec, int]]:
    """Fine-tuning instead of full training: LoRA on half-precision frozen weights, QLoRA on
    4-bit ones, both with activation checkpointing (what people run when nothing else fits);
    for a LoRA step, QLoRA (its frozen weights in 4 bits). ``level`` names the methods and
    whether each runs one sample per micro-batch."""
    if step.finetune_method == "qlora":
        return []
    if step.finetune_method == "lora":  # adapters already: what is left is 4-bit base weights
        level = tuple((method, micro) for method, micro in level if method == "qlora")
    # one sample per micro-batch only means something when the batch has more than one
    return [
        _recipe(step, gpu, method, micro)
        for method, micro in level
        if not (micro and step.batch_size == 1)
    ]


def _recipe(step: StepSpec, gpu: GpuSpec, method: str, micro: bool) -> tuple[str, StepSpec, int]:
    dtype = _amp_for(gpu)
    # fp16 adapters under fp16 autocast: GradScaler cannot unscale their gradients; the 16-bit
    # weights compute in 16 bits without it (peft's default fp32 adapters keep the autocast)
    scaled = dtype == "fp16" and step.amp == "fp16" and step.adapter_dtype == "params"
    amp = "none" if scaled else step.amp
    # fp32 adapters need no master copy (a full step's master_weights=true has none to keep)
    masters = step.master_weights and step.adapter_dtype == "params"
    base = replace(step, params_dtype=dtype, checkpointing="full", checkpointing_every=1,
                   amp=amp, finetune_method=method, master_weights=masters)  # fmt: skip
    accumulation = step.batch_size if micro else 1
    if micro:
        base = replace(base, batch_size=1, grad_accum=step.grad_accum * accumulation)
    extra = [_split(1, step.grad_accum * accumulation)] if micro else []
    label = " + ".join([f"finetune.method={method}", *_changed_keys(step, base), *extra])
    return label, base, accumulation


# A recipe's label names what it changes of these, in this order, as command-line keys
_LABEL_KEYS = {"params_dtype": "params_dtype", "amp": "amp", "checkpointing": "checkpointing",
               "checkpointing_every": "checkpointing.every", "optimizer": "optimizer"}  # fmt: skip


def _changed_keys(step: StepSpec, changed: StepSpec) -> list[str]:
    """``key=value`` for each of :data:`_LABEL_KEYS` that ``changed`` sets otherwise."""
    return [f"{key}={getattr(changed, field)}" for field, key in _LABEL_KEYS.items()
            if getattr(changed, field) != getattr(step, field)]  # fmt: skip


def step_diff(base: StepSpec, changed: StepSpec) -> dict[str, Any]:
    a, b = base.to_dict(), changed.to_dict()
    return {k: v for k, v in b.items() if a[k] != v}
