"""What the user asks about: which model, and what one training step does."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Any

from boom_ml.errors import InvalidInputError, UnknownModelError, suggest
from boom_ml.plain_arguments import plain
from boom_ml.trace.sdpa_select import check_group as check_sdpa_group

# in --help's order (the error's list had run in the order they were added: a hunt); issue
# #15's recipes among them: AdamW forced to torch's fused kernel, bitsandbytes' 8-bit
# blockwise AdamW (paged: its state in unified memory on the host), Lion, Nesterov SGD
OPTIMIZERS = (
    "sgd",
    "sgd-momentum",
    "sgd-nesterov",
    "adam",
    "adamw",
    "adamw-fused",
    "adamw8bit",
    "paged-adamw8bit",
    "lion",
    "adagrad",
    "rmsprop",
    "adafactor",
    "none",
)
AMP_MODES = ("none", "fp16", "bf16")
MODEL_SCHEMES = ("torchvision", "timm", "hf", "file")  # boom_ml.zoo has one builder each
# The field an HF config counts its transformer layers in (Llama and most; GPT-2; T5, GPT-Neo)
HF_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
# auto = what the stack's PyTorch picks (boom_ml/stack.py); the rest name it
OPTIMIZER_IMPLS = ("auto", "foreach", "fused", "loop")
# selective: PyTorch's selective activation checkpointing (matmul outputs saved)
CHECKPOINTING_MODES = ("none", "full", "selective")
# The ``finetune.*`` option keys (the CLI's ``finetune.method=lora``, the API's ``finetune=``)
# and the StepSpec fields they set
FINETUNE_KEYS = {
    "method": "finetune_method",
    "r": "lora_r",
    "alpha": "lora_alpha",
    "dropout": "lora_dropout",
    "targets": "lora_targets",
    "double_quant": "double_quant",
    "adapter_dtype": "adapter_dtype",
}
# fp32: peft's get_peft_model default (autocast_adapter_dtype=True: bf16/fp16 adapters made
# fp32); params: the base layer's dtype (autocast_adapter_dtype=False; TRL's bf16 QLoRA cast)
ADAPTER_DTYPES = ("fp32", "params")
PARAMS_DTYPES = ("fp32", "bf16", "fp16")
ZERO_GRAD_MODES = ("set_to_none", "zero")
FINETUNE_METHODS = ("full", "lora", "qlora")


@dataclass(frozen=True)
class ModelSpec:
    """A model named by ``scheme:name`` (torchvision, timm, hf, file) or a bare name."""

    text: str
    options: dict[str, Any] = field(default_factory=dict)
    # what progress lines call it where ``text`` is a file boom-ml wrote (a layout's per-rank
    # config); never part of a key
    label: str = field(default="", compare=False)

    @property
    def shown(self) -> str:
        return self.label or self.text

    @property
    def scheme(self) -> str | None:
        head, sep, _ = self.text.partition(":")
        return head if sep and head in MODEL_SCHEMES else None

    @property
    def name(self) -> str:
        return self.text.partition(":")[2] if self.scheme else self.text


def check_model_syntax(text: Any) -> None:
    """The model spec's form (``scheme:name``, a bare name, ``file:path.py:factory``).

    Names are not looked up here: that needs the model libraries. A file model's path is
    checked because a mistyped path is the common mistake and costs one ``stat``.
    """
    if not isinstance(text, str):
        raise UnknownModelError(f"model must be a name such as torchvision:resnet50, got {text!r}")
    if not text.strip():
        raise UnknownModelError("empty model name; e.g. model=torchvision:resnet50")
    spec = ModelSpec(text.strip())
    if spec.scheme is None:
        head, sep, _ = spec.text.partition(":")
        if sep and head.endswith(".py"):  # a factory file without its scheme
            raise UnknownModelError(f"a model factory in a file is named file:{spec.text}")
        # "C:\\path" or "org/name:x" are not schemes; "torchvison:resnet50" is a typo of one
        if sep and head and "/" not in head and "." not in head:
            raise UnknownModelError(
                f"unknown model scheme {head!r} in {spec.text!r}{suggest(head, MODEL_SCHEMES)};"
                f" use one of: {', '.join(MODEL_SCHEMES)}"
            )
        return
    if not spec.name.strip():
        raise UnknownModelError(f"{spec.text!r} names no model after the scheme")
    if spec.scheme == "file":
        path, sep, factory = spec.name.rpartition(":")
        if not sep or not path or not factory or factory.endswith(".py"):
            where = spec.name if spec.name.endswith(".py") else path or spec.name
            raise UnknownModelError(
                f"{spec.text} names no factory; write file:{where}:<function returning an nn.Module>"
            )
        if not Path(path).expanduser().is_file():
            raise UnknownModelError(f"{spec.text}: no such file {path!r}")


# Above it a step's tensor sizes in bytes overflow 64-bit counts for common models
MAX_BATCH_SIZE = 1 << 31


@functools.cache
def _step_fields() -> frozenset[str]:
    return frozenset(f.name for f in dataclass_fields(StepSpec))


@dataclass(frozen=True)
class StepSpec:
    """One training step: batch shape, optimizer, precision and recomputation choices."""

    batch_size: int = 1
    seq_len: int | None = None
    image_size: int | None = None
    optimizer: str = "adamw"
    amp: str = "none"
    checkpointing: str = "none"
    tf32: bool = False
    # PyTorch's two TF32 switches; None: on if tf32, else PyTorch's default (matmul off, cuDNN on)
    tf32_matmul: bool | None = None
    tf32_cudnn: bool | None = None
    optimizer_impl: str = "auto"  # foreach | fused | loop, or auto
    grad_accum: int = 1  # micro-batches per optimizer step (gradients live across them)
    params_dtype: str = "fp32"  # dtype of parameters, hence of gradients and optimizer state
    checkpointing_every: int = 1  # checkpoint every K-th block (full or selective)
    finetune_method: str = "full"  # full | lora | qlora (peft LoRA; qlora: NF4 base weights)
    lora_r: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.05
    lora_targets: tuple[str, ...] | None = None  # None: peft's default for the architecture
    double_quant: bool = True  # qlora: quantise the NF4 absmax again (bitsandbytes' default)
    adapter_dtype: str = "fp32"  # LoRA adapters: fp32 (peft's default) | params (base layer's)
    # attention architecture group the trace follows (boom_ml/trace/sdpa_select.py: GPUs that
    # pick the same SDPA kernels); None: the caller's choice, the A100's group when traced
    sdpa_group: str | None = None
    # set_to_none: gradients freed before the step and created by backward (PyTorch >= 2.0's
    # default); zero: kept and zeroed in place, one fill kernel per gradient, and backward
    # accumulates into them (the default of Module/Optimizer.zero_grad in PyTorch 1.x)
    zero_grad: str = "set_to_none"
    # convolutions on NHWC tensors (model and input in torch.channels_last); NCHW (False) pays
    # cuDNN's layout transforms around tensor-core convolutions (timing/conv_layout.py). The
    # trace stays NCHW: the layout changes no shape, FLOP or byte count of the ops traced.
    channels_last: bool = False
    # 16-bit parameters (params_dtype bf16/fp16, amp none) stepped through fp32 master copies
    # held by the optimizer (Megatron-LM, DeepSpeed, apex O2); fp16 adds a loss scale
    master_weights: bool = False

    def __new__(cls, *args: Any, **kwargs: Any) -> StepSpec:
        # a misspelt keyword (bacth_size=4) had been a bare TypeError, where predict()'s is
        # one line with a did-you-mean (a hunt)
        names = _step_fields()
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise InvalidInputError(
                f"StepSpec() takes no argument {unknown[0]!r}{suggest(unknown[0], names)}"
            )
        return super().__new__(cls)

    def __post_init__(self) -> None:
        # a sweep over np.arange or a pandas column hands NumPy scalars, which predict() reads
        # as the numbers they hold; a StepSpec had called np.int64(4) no integer (a hunt)
        for name in _step_fields():
            value = getattr(self, name)
            if type(value).__module__ == "numpy":
                object.__setattr__(self, name, plain(value))
        check_positive("batch_size", self.batch_size)
        if self.batch_size > MAX_BATCH_SIZE:  # a hunt: 2^36 overflowed pandas' int64 bytes
            raise InvalidInputError(
                f"batch_size={self.batch_size} is above {MAX_BATCH_SIZE} (2^31): the step's byte"
                " counts would overflow"
            )
        if self.seq_len is not None:
            check_positive("seq_len", self.seq_len)
        if self.image_size is not None:
            check_positive("image_size", self.image_size)
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        check_choice("amp", self.amp, AMP_MODES)
        check_choice("checkpointing", self.checkpointing, CHECKPOINTING_MODES)
        check_choice("optimizer.impl", self.optimizer_impl, OPTIMIZER_IMPLS)
        check_positive("grad_accum", self.grad_accum)
        check_choice("zero_grad", self.zero_grad, ZERO_GRAD_MODES)
        check_choice("params_dtype", self.params_dtype, PARAMS_DTYPES)
        check_positive("checkpointing.every", self.checkpointing_every)
        check_choice("finetune.method", self.finetune_method, FINETUNE_METHODS)
        check_sdpa_group(self.sdpa_group)
        check_positive("finetune.r", self.lora_r)
        check_number("finetune.alpha", self.lora_alpha, 0.0, None)
        check_number("finetune.dropout", self.lora_dropout, 0.0, 1.0)
        # 16 and 16.0 are one setting: one trace-cache key
        object.__setattr__(self, "lora_alpha", float(self.lora_alpha))
        object.__setattr__(self, "lora_dropout", float(self.lora_dropout))
        check_bool("finetune.double_quant", self.double_quant)
        check_choice("finetune.adapter_dtype", self.adapter_dtype, ADAPTER_DTYPES)
        check_bool("channels_last", self.channels_last)
        check_bool("master_weights", self.master_weights)
        check_bool("tf32", self.tf32)
        for name in ("tf32_matmul", "tf32_cudnn"):  # None: the default
            if getattr(self, name) is not None:
                check_bool(name, getattr(self, name))
        if self.master_weights and (self.params_dtype == "fp32" or self.amp != "none"):
            raise InvalidInputError(
                "master_weights=true keeps fp32 copies of 16-bit parameters: it needs "
                f"params_dtype=bf16|fp16 and amp=none (got params_dtype={self.params_dtype}, "
                f"amp={self.amp})"
            )
        if self.master_weights and self.optimizer == "none":
            raise InvalidInputError(
                "master_weights=true: the fp32 copies are the optimizer's (it steps them), so "
                "it needs an optimizer; with optimizer=none use master_weights=false"
            )
        targets = self.lora_targets
        if targets is not None:
            if isinstance(targets, str) or not all(isinstance(t, str) and t for t in targets):
                raise InvalidInputError(
                    f"finetune.targets must be a list of module names, got {targets!r}"
                )
            if "all-linear" in targets and len(targets) > 1:  # it had "named no module"
                raise InvalidInputError(
                    f"finetune.targets: all-linear stands alone (peft reads it as the whole"
                    f" list: every linear layer but the head), got [{','.join(targets)}]"
                )
            # a list from JSON or Hydra: a tuple keeps the spec hashable (trace caches key on it)
            object.__setattr__(self, "lora_targets", tuple(targets))
        fp32_adapters = self.finetune_method != "full" and self.adapter_dtype == "fp32"
        if self.master_weights and fp32_adapters:
            # all that trains is fp32 already: there is nothing to copy (it had run unchanged
            # with exit 0, a hunt)
            raise InvalidInputError(
                f"master_weights=true keeps fp32 copies of 16-bit trainable parameters, and"
                f" finetune.method={self.finetune_method} trains fp32 adapters"
                " (finetune.adapter_dtype=fp32, peft's default): use master_weights=false, or"
                " finetune.adapter_dtype=params for adapters in the weights' dtype"
            )
        if self.amp == "fp16" and self.params_dtype == "fp16" and not fp32_adapters:
            # LoRA's fp32 adapters (peft's default) are all that trains: their gradients unscale
            raise InvalidInputError(
                "amp=fp16 with params_dtype=fp16: GradScaler cannot unscale fp16 gradients; "
                "use amp=none for pure fp16 training"
                + (
                    " (or finetune.adapter_dtype=fp32, peft's default)"
                    if self.finetune_method != "full"
                    else ""
                )  # fmt: skip
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def label(self) -> str:
        """'batch 4, seq 2048, amp=bf16, checkpointing=full': what sets this step apart."""
        parts = [f"batch {self.batch_size}"]
        if self.seq_len:
            parts.append(f"seq {self.seq_len}")
        if self.image_size:
            parts.append(f"image {self.image_size}")
        default = StepSpec()
        for key in ("amp", "params_dtype", "master_weights", "checkpointing", "optimizer",
                    "finetune_method"):  # fmt: skip
            value = getattr(self, key)
            if value != getattr(default, key):
                parts.append(f"{key}={str(value).lower() if isinstance(value, bool) else value}")
        if self.sdpa_group:  # a GPU list traces once per attention group: which one this is
            parts.append(f"attention kernels of {self.sdpa_group}")
        return ", ".join(parts)

    def tf32_switches(self) -> tuple[bool, bool]:
        """(matmul, cudnn): a switch set explicitly wins; tf32=true turns both on."""
        return tf32_switches(self.tf32, self.tf32_matmul, self.tf32_cudnn)


def tf32_switches(tf32: bool | None, matmul: bool | None, cudnn: bool | None) -> tuple[bool, bool]:
    """(matmul, cudnn) of a step's fields (also its JSON): an explicit switch wins, tf32
    turns matmuls on, cuDNN's is on unless turned off (PyTorch's defaults)."""
    return bool(tf32 if matmul is None else matmul), bool(True if cudnn is None else cudnn)


# attention=: the HF attention implementation (attn_implementation) a model is built with
ATTENTION_CHOICES = ("sdpa", "eager")
# hf build choices with keys of their own (the zoo's build options), never model_options
BUILD_OPTION_KEYS = {"attn_implementation": "attention", "moe_imbalance": "moe.imbalance"}
# and their defaults: a Session built without them traces (and caches) what predict() does
BUILD_OPTION_DEFAULTS = {"attn_implementation": "sdpa", "moe_imbalance": 1.0}


def check_model_options(value: Any) -> None:
    """``model_options``: keyword names to values (what the model is built with)."""
    if value is None:
        return
    if not isinstance(value, Mapping):
        raise InvalidInputError(f"model_options must be a mapping of its options, got {value!r}")
    for key in value:
        if not isinstance(key, str) or not key.isidentifier():
            raise InvalidInputError(f"model_options keys are keyword names, got {key!r}")
        if key in BUILD_OPTION_KEYS:
            raise InvalidInputError(
                f"model_options.{key}: set it with {BUILD_OPTION_KEYS[key]}= instead"
            )


def check_bool(name: str, value: Any) -> None:
    """true or false, not a string that reads like one (the API takes "false" as truthy)."""
    if not isinstance(value, bool):
        raise InvalidInputError(f"{name} must be true or false, got {value!r}")


# the words a command line says a switch with: Hydra reads true / false as booleans and
# passes on / off / yes / no as strings (advice=off had been refused while max_batch=off
# and cache=off were taken)
BOOL_WORDS = {"true": True, "on": True, "yes": True, "false": False, "off": False, "no": False}


def bool_word(value: Any) -> Any:
    """``value`` as a bool where it is a switch's word (on, off, yes, no, true, false) or
    1 / 0 (Hydra reads those as numbers); anything else unchanged, for :func:`check_bool`
    to refuse."""
    if isinstance(value, str) and value.strip().lower() in BOOL_WORDS:
        return BOOL_WORDS[value.strip().lower()]
    if type(value) is int and value in (0, 1):
        return bool(value)
    return value


def cache_setting(value: Any) -> bool:
    """``cache``: a bool, or on / off (YAML reads `cache: on` as True; Hydra's command line
    passes `cache=off` as a string)."""
    value = bool_word(value)
    if isinstance(value, bool):
        return value
    raise InvalidInputError(f"cache must be on or off, got {value!r}")


def check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        # batch_size=1e3 reaches here as the float 1000.0: say how to write it
        whole = isinstance(value, float) and value.is_integer() and value >= 1
        hint = f" (a float: write {int(value)})" if whole else ""
        raise InvalidInputError(f"{name} must be an integer >= 1, got {value!r}{hint}")


def check_number(name: str, value: Any, low: float, high: float | None) -> None:
    """A real number in [low, high] (high None: no upper bound)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise InvalidInputError(f"{name} must be a number {bound}, got {value!r}")


# what a true / false given for a key of named choices most likely meant (HF's
# gradient_checkpointing=True is checkpointing=full)
BOOL_MEANS = {"checkpointing": ("none", "full")}


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value in choices:
        return
    if isinstance(value, bool):  # Hydra reads true / false as booleans: say them as typed
        meant = BOOL_MEANS.get(name)
        hint = f" (did you mean {name}={meant[value]}?)" if meant else ""
        raise InvalidInputError(
            f"unknown {name} {str(value).lower()}; choose one of: {', '.join(choices)}{hint}"
        )
    raise InvalidInputError(f"unknown {name} {value!r}; choose one of: {', '.join(choices)}")


# max_batch=auto searches the largest batch per GPU for up to this many GPUs: the search
# replays the step through the allocator near each GPU's limit (about 0.4 s per GPU on a
# laptop core), which would dominate a gpu=all comparison. The advisor's fine-tuning recipes
# follow the same rule (each is a trace per attention group: +80 s cold for Llama-3-8B on
# every GPU, 157 -> 239 s).
MAX_BATCH_AUTO_GPUS = 8


def max_batch_setting(value: Any) -> str:
    """``auto`` | ``on`` | ``off`` from a CLI string, a YAML boolean or a Python bool."""
    switch = bool_word(value)  # on, off, true, no, 0, ...
    if isinstance(switch, bool):
        return "on" if switch else "off"
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    raise InvalidInputError(f"max_batch must be auto, on or off, got {value!r}")


def search_max_batch(value: Any, n_gpus: int) -> bool:
    """Whether to search the largest batch: ``on``, or ``auto`` for a few GPUs."""
    setting = max_batch_setting(value)
    return setting == "on" or (setting == "auto" and n_gpus <= MAX_BATCH_AUTO_GPUS)


def finetune_problem(step: StepSpec) -> str:
    """Why ``step``'s adapter settings would change nothing ('' when none would): a LoRA key
    away from its default under ``finetune_method="full"``, ``double_quant`` away from its
    default without QLoRA. ``api.predict`` and ``Session.evaluate`` refuse such a step."""
    default = StepSpec()
    moved = [key for key, name in FINETUNE_KEYS.items()
             if key != "method" and getattr(step, name) != getattr(default, name)]  # fmt: skip
    lora_only = [key for key in moved if key != "double_quant"]
    if step.finetune_method == "full" and lora_only:
        return (
            f"finetune.{lora_only[0]} applies to finetune.method=lora or qlora, not full "
            "(every weight trains)"
        )
    if step.finetune_method != "qlora" and "double_quant" in moved:
        return f"finetune.double_quant applies to finetune.method=qlora, not {step.finetune_method}"
    return ""


def finetune_fields(finetune: dict[str, Any] | None) -> dict[str, Any]:
    """StepSpec fields from the ``finetune`` mapping (None values keep the defaults)."""
    finetune = dict(finetune or {})
    unknown = sorted(set(finetune) - set(FINETUNE_KEYS))
    if unknown:
        raise InvalidInputError(
            f"unknown finetune option(s): {', '.join(unknown)}; known: {', '.join(FINETUNE_KEYS)}"
        )
    fields = {FINETUNE_KEYS[k]: v for k, v in finetune.items() if v is not None}
    if isinstance(fields.get("lora_targets"), str):  # finetune.targets=q_proj
        fields["lora_targets"] = [fields["lora_targets"]]
    problem = finetune_problem(StepSpec(**fields))  # types and ranges first: "r must be an
    if problem:  # integer", not "applies to"
        raise InvalidInputError(problem)
    if fields.get("lora_targets") is not None and not list(fields["lora_targets"]):
        raise InvalidInputError(
            "finetune.targets=[] names no module; leave it out for peft's default targets"
        )
    return fields
