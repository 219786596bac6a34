"""Training recipes applied to a meta-built model before the tracer materialises it.

* ``params_dtype``: parameters (and buffers, as ``model.to(dtype)`` does) in fp32, bf16 or
  fp16, but those an HF model keeps in fp32 when ``from_pretrained(dtype=...)`` loads it
  (its ``_keep_in_fp32_modules`` in fp16, ``_keep_in_fp32_modules_strict`` in fp16 and bf16:
  T5's ``wo``, MoE routers); gradients and the optimizer's state follow the parameters' dtype.
* ``finetune_method=lora``: the real peft (``LoraConfig`` + ``get_peft_model``) injects its
  LoRA layers into the model in place and freezes everything else; adapters are fp32, as
  peft's ``get_peft_model`` makes them by default (``autocast_adapter_dtype=True`` upcasts
  bf16/fp16 ones, and peft's forward casts each adapter's input to it), or with
  ``adapter_dtype="params"`` in their base layer's dtype (``autocast_adapter_dtype=False``:
  ``params_dtype`` but beside a layer kept in fp32; TRL's bf16 cast of QLoRA adapters).
* ``finetune_method=qlora``: LoRA as above, and every frozen ``nn.Linear`` except the output
  head becomes an :class:`~boom_ml.zoo.nf4.NF4Linear` (what transformers'
  ``BitsAndBytesConfig(load_in_4bit=True)`` quantises: all linear layers but the head),
  computing in ``params_dtype``, or in the autocast dtype when the parameters are fp32.

Frozen parameters get no gradient and no optimizer state in the trace: the step only gives
``requires_grad`` parameters a gradient, and optimizers skip parameters without one.
"""

from __future__ import annotations

import re
import warnings
from collections import Counter
from itertools import chain
from typing import Any

import torch
from torch import nn

from boom_ml.errors import InvalidInputError, suggest
from boom_ml.specs import StepSpec
from boom_ml.zoo.hf_moe import is_expert_block
from boom_ml.zoo.nf4 import NF4Linear

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_AMP = {"fp16": torch.float16, "bf16": torch.bfloat16}
ADAPTER_MARK = "lora_"  # peft's adapter modules: lora_A, lora_B, lora_dropout, ...


def compute_dtype(step: StepSpec) -> torch.dtype:
    """The dtype a 4-bit layer dequantises to (bnb's ``bnb_4bit_compute_dtype``)."""
    if step.params_dtype != "fp32":
        return DTYPES[step.params_dtype]
    return _AMP.get(step.amp, torch.float32)


def apply_recipe(module: nn.Module, step: StepSpec) -> dict[str, Any]:
    """Cast, add LoRA adapters and quantise ``module`` in place; returns facts for the graph."""
    facts: dict[str, Any] = {"params_dtype": step.params_dtype, "finetune": step.finetune_method}
    dtype = DTYPES[step.params_dtype]
    if dtype != torch.float32:
        kept = cast_as_loaded(module, dtype)
        if kept:
            facts["fp32_parameters"] = kept
    if step.finetune_method == "full":
        return facts
    last = _last_weight_module(module)  # named before peft renames the model's modules
    facts.update(_add_lora(module, step))
    if dtype != torch.float32:
        _set_adapter_dtypes(module, step.adapter_dtype)
    facts["adapter_dtypes"] = sorted({DTYPE_NAMES.get(p.dtype, str(p.dtype))
                                      for p in module.parameters() if p.requires_grad})  # fmt: skip
    if step.finetune_method == "qlora":
        layers = quantize_linears(module, compute_dtype(step), step.double_quant, last)
        facts["nf4_layers"] = layers
        facts["method_notes"] = [
            "qlora: NF4 weights and dequantise kernels analytic (bitsandbytes layout)"
        ]
        if not layers:
            kinds = sorted({type(m).__name__ for m in module.modules()
                            if isinstance(m, nn.Linear) and type(m) is not nn.Linear})  # fmt: skip
            facts["method_notes"].append(
                "qlora: no layer quantised: transformers' bitsandbytes integration converts "
                "nn.Linear and Conv1D layers only"
                + (f" (this model's are {', '.join(kinds)})" if kinds else "")
            )
        # an expert block holds only expert weights (3-D in transformers 5, DBRX's 2-D stacks)
        fused = sum(p.numel() for m in module.modules() if is_expert_block(m)
                    for p in m.parameters() if not p.requires_grad)  # fmt: skip
        # transformers 5 fuses MoE experts into 3-D tensors, not nn.Linear: not quantised here
        if fused:
            facts["unquantized_expert_parameters"] = fused
            # the count is in the recipe line, not here: notes are text, and a model traced
            # shallow and repeated (trace/repeat.py) extends counts, never text
            facts["method_notes"].append(
                f"qlora: fused MoE expert weights not quantised (kept in {step.params_dtype})"
            )
    return facts


def _add_lora(module: nn.Module, step: StepSpec) -> dict[str, Any]:
    from peft import LoraConfig, get_peft_model  # ~seconds: only when LoRA is asked for

    targets: Any = list(step.lora_targets) if step.lora_targets else None
    chosen: dict[str, Any] = {}
    if targets is None:
        targets, chosen = default_targets(module)
    if targets == ["all-linear"]:
        targets = "all-linear"  # peft's own shorthand: every linear layer but the head
    else:
        _check_targets(module, targets)
    config = LoraConfig(
        r=step.lora_r,
        lora_alpha=step.lora_alpha,
        lora_dropout=step.lora_dropout,
        target_modules=targets,
    )
    # named before peft, which may have wrapped some of them when it stops
    linear = sorted({_target_name(n) for n, m in module.named_modules()
                     if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"},
                    key=_natural)  # fmt: skip
    try:
        # Injects the adapters into ``module`` itself: the tracer keeps running ``module``.
        with warnings.catch_warnings():  # peft reads transformers' deprecated alias
            warnings.filterwarnings(
                "ignore",
                message="`is_gradient_checkpointing` is deprecated",
                category=FutureWarning,
            )
            # GPT-2's Conv1D: peft sets fan_in_fan_out itself, as a GPT-2 recipe would (and
            # back for an nn.Linear target beside them, lm_head)
            warnings.filterwarnings("ignore", message="fan_in_fan_out is set to (False|True)")
            # a tied head as a target: peft warns of merging and exporting the adapter, which
            # change neither the step's memory nor its time
            warnings.filterwarnings("ignore", message="Model has `tie_word_embeddings=True`")
            # all-linear on fused MoE experts: peft warns that the rank and alpha patterns it
            # sets for gate_up_proj matched nothing (a hunt: the lines reached the user); the
            # trainable count is peft's own either way
            warnings.filterwarnings("ignore", message="The following (rank|alpha)_pattern keys")
            peft_model = get_peft_model(
                module, config, autocast_adapter_dtype=step.adapter_dtype == "fp32"
            )
    except ValueError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else "no target modules"
        if unwrappable := re.match(r"Target module (\w+)\(", first):
            # peft prints the whole module, over many lines: name the target and its class
            cls = unwrappable.group(1)
            named = sorted({n.rpartition(".")[2] for n, m in module.named_modules()
                            if type(m).__name__ == cls and n.rpartition(".")[2] in (targets or ())})  # fmt: skip
            first = (f"{', '.join(repr(n) for n in named) or 'a target'} is a {cls}, not a layer "
                     "peft wraps (Linear, transformers' Conv1D, Embedding, Conv1d/2d/3d)")  # fmt: skip
        if "ParamWrapper" in first:  # all-linear on fused MoE experts: 3-D weights, no dropout
            hint = "LoRA on a MoE model's fused expert weights needs finetune.dropout=0"
        else:
            hint = ("name them with finetune.targets=[...] (module names such as q_proj, or "
                    f"all-linear; this model's linear layers: {', '.join(linear[:16]) or 'none'})")  # fmt: skip
            if step.lora_dropout and any(is_expert_block(m) for m in module.modules()):
                # so that following the hint does not meet the ParamWrapper error above
                hint += (
                    "; all-linear also adapts its fused MoE expert weights: add finetune.dropout=0"
                )
        if targets is None:  # none given, none found: peft's words assume some were passed
            first = "no target set of peft's table has all its modules in this model"
        raise InvalidInputError(
            f"finetune.method={step.finetune_method}: peft cannot place LoRA adapters ({first}); "
            + hint
        ) from err
    trainable, total = peft_model.get_nb_trainable_parameters()
    placed = peft_model.peft_config["default"]
    # all-linear on fused MoE experts: peft adapts their 3-D weights as parameters
    parameters = sorted(getattr(placed, "target_parameters", None) or [])
    return {
        **chosen,
        "lora_targets": sorted(placed.target_modules),
        **({"lora_target_parameters": parameters} if parameters else {}),
        "peft_trainable_parameters": int(trainable),
        "peft_all_parameters": int(total),
    }


def _check_targets(module: nn.Module, targets: list[str] | None) -> None:
    """Each target names a module, as peft matches one (the name itself or its dotted
    suffix): peft places the targets it finds and drops the others silently, so a typo
    (``vv_proj``) changed the prediction without a word. A target naming a layer by its
    index is left to peft: a model traced shallow (trace/repeat.py) lacks the deep layers."""
    names = [name for name, _ in module.named_modules() if name]
    layers = getattr(getattr(module, "config", None), "num_hidden_layers", None)
    # a layout builds its ranks with 1 and 2 layers: a kind of module that starts deeper (a
    # DeepSeek MoE block after its dense first layer) is not among them
    shallow = (f" as built here ({layers} layer{'s' if layers > 1 else ''}: a multi-GPU layout"
               " builds its ranks so, without the modules of deeper layers)"
               if isinstance(layers, int) and layers <= 2 else "")  # fmt: skip
    for target in targets or ():
        if re.search(r"(^|\.)\d+(\.|$)", target):
            continue
        if not any(n == target or n.endswith("." + target) for n in names):
            leaves = sorted({n.rpartition(".")[2] for n in names})
            raise InvalidInputError(
                f"finetune.targets: {target!r} names no module of this model{shallow}"
                f"{suggest(target.rpartition('.')[2], leaves)}"
            )


def default_targets(module: nn.Module) -> tuple[list[str] | None, dict[str, Any]]:
    """The LoRA targets peft would pick, looked up here (for MoE configs such as Mixtral
    peft 0.21 ends up with an empty set when left to resolve them itself), and where peft
    has none for the architecture (Phi-3, Qwen3-MoE) or its names are gone from the model
    (transformers 5's ViT says ``q_proj``, peft ``query``): the target set of peft's table
    that most architectures use and this model has every name of (``q_proj,v_proj``,
    ``qkv_proj``), said in the recipe's ``lora_targets_chosen``. None: peft decides."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as table

    model_type = getattr(getattr(module, "config", None), "model_type", None)
    names = {name.rpartition(".")[2] for name, _ in module.named_modules()}
    own = table.get(model_type)
    if own and set(own) <= names:
        return list(own), {}
    counts = Counter(tuple(v) for v in table.values())  # in order of first use on ties
    for candidate, _ in counts.most_common():
        if set(candidate) <= names:
            why = (
                f"peft's default for {model_type} ({','.join(own)}) names no module here"
                if own
                else f"peft has no default for {model_type}"
            )
            note = f"{why}; its most common one this model has"
            return list(candidate), {"lora_targets_chosen": note}
    return None, {}


def _fp32_patterns(module: nn.Module, dtype: torch.dtype) -> list[str]:
    """The name patterns transformers loads in fp32 under ``dtype`` (its dtype plan), from
    the first HF model in ``module``; none for other models."""
    for sub in module.modules():
        plan = getattr(sub, "_get_dtype_plan", None)
        if callable(plan):
            return [k for k, v in plan(dtype).items() if v == torch.float32]
    return []


def _set_adapter_dtypes(module: nn.Module, adapter_dtype: str) -> None:
    """Adapters in fp32 (peft's default) or, with ``adapter_dtype="params"``, in their base
    layer's dtype (``autocast_adapter_dtype=False``: params_dtype, fp32 for a layer the model
    keeps in fp32); on the meta device peft leaves them fp32 either way: set them so. The base
    layers keep the dtypes ``cast_as_loaded`` gave them, decided once on the model's own names
    (peft's renamed ones would match other patterns)."""
    for layer in module.modules():
        base = getattr(layer, "base_layer", None)
        weight = getattr(base, "weight", None)
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
            continue
        for name, param in layer.named_parameters():
            want = weight.dtype if adapter_dtype == "params" else torch.float32
            if not name.startswith("base_layer.") and param.dtype != want:
                param.data = param.data.to(want)


def cast_as_loaded(module: nn.Module, dtype: torch.dtype) -> int:
    """``module.to(dtype)`` (on the meta device: dtypes only, tied parameters stay tied), then
    the parameters and buffers whose names an fp32 pattern of the model finds (as
    transformers' loader searches state-dict keys, ``*`` any text) back in fp32; returns how
    many parameter elements stay fp32."""
    module.to(dtype)
    patterns = _fp32_patterns(module, dtype)
    if not patterns:
        return 0
    found = re.compile("|".join(f"(?:{p.replace('*', '.*')})" for p in patterns))
    kept = 0
    # a tied tensor by its first name, the checkpoint's key (embed_tokens, not the tied
    # lm_head the loader ties to it afterwards)
    for name, tensor in chain(module.named_parameters(), module.named_buffers()):
        if found.search(name) and tensor.is_floating_point():
            tensor.data = tensor.data.to(torch.float32)
            kept += tensor.numel() if isinstance(tensor, nn.Parameter) else 0
    return kept


def _keep_in_fp32(module: nn.Module) -> list[str]:
    """The model's ``_keep_in_fp32_modules`` (T5: ``wo``), which transformers' quantizer
    leaves unquantised; the first HF model inside a peft wrapper answers."""
    for sub in module.modules():
        keep = getattr(type(sub), "_keep_in_fp32_modules", None)
        if keep is not None:
            return list(keep)
    return []


def _output_heads(module: nn.Module) -> set[int]:
    """The output head, and the layer it wraps where peft has put LoRA on it (targets
    naming ``lm_head``): transformers leaves the head unquantised either way."""
    get = getattr(module, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, nn.Module):
        return set()
    base = getattr(head, "base_layer", None)
    return {id(head)} | ({id(base)} if isinstance(base, nn.Module) else set())


def _last_weight_module(module: nn.Module) -> nn.Module | None:
    """The module transformers' ``get_keys_to_not_convert`` keeps unquantised as the model's
    last: the owner of its last parameter, where that is a ``.weight`` (it strips that suffix
    alone, so a head whose last parameter is its bias, ViT's classifier, is quantised)."""
    names = [name for name, _ in module.named_parameters()]
    if not names or not names[-1].endswith(".weight"):
        return None
    return module.get_submodule(names[-1].removesuffix(".weight"))


def quantize_linears(
    module: nn.Module, dtype: torch.dtype, double_quant: bool, last: nn.Module | None = None
) -> int:
    """Replace the frozen layers transformers' bitsandbytes integration converts
    (``replace_with_bnb_linear``: exactly ``nn.Linear``, not its subclasses, and GPT-2's
    ``Conv1D``) by NF4Linear, but the output head and the model's ``_keep_in_fp32_modules``
    (T5's ``wo``, matched as transformers matches them) and ``last`` (``_last_weight_module``
    of the model before peft); returns the count.

    LoRA's own ``lora_A`` / ``lora_B`` (trainable) stay as they are; the base layer a LoRA
    layer wraps is quantised and clones its output, as peft's 4-bit LoRA layer does.
    """
    from transformers.pytorch_utils import Conv1D

    try:
        from transformers.quantizers.quantizers_utils import should_convert_module
    except ImportError:  # older transformers: the name itself or a suffix of it

        def should_convert_module(path: str, patterns: list[str]) -> bool:
            return not any(path == k or path.endswith("." + k) for k in patterns)

    skip = _output_heads(module) | ({id(last)} if last is not None else set())
    keep = _keep_in_fp32(module)
    swaps: list[tuple[nn.Module, str, nn.Module, bool]] = []
    for name, parent in module.named_modules():
        if ADAPTER_MARK in name.rpartition(".")[2]:
            continue
        for child_name, child in parent.named_children():
            if not (type(child) is nn.Linear or isinstance(child, Conv1D)) or id(child) in skip:
                continue
            if child.weight.requires_grad:  # trainable (an adapter, or not frozen by peft)
                continue
            wrapped = child_name == "base_layer"  # the layer's own name is its LoRA wrapper's
            path = name if wrapped else f"{name}.{child_name}".lstrip(".")
            if keep and not should_convert_module(path, keep):
                continue
            swaps.append((parent, child_name, child, wrapped))
    for parent, child_name, child, wrapped in swaps:
        setattr(parent, child_name, NF4Linear(child, dtype, double_quant, clone_output=wrapped))
    return len(swaps)


def logical_parameters(module: nn.Module) -> int:
    """Parameters the model stands for: NF4 layers count their weights, not their bytes."""
    params = sum(p.numel() for p in module.parameters())
    return params + sum(m.logical_numel for m in module.modules() if isinstance(m, NF4Linear))


def _target_name(name: str) -> str:
    """The name a ``finetune.targets`` entry matches a module by: its last part, with the
    parts before it while that is an index (``net.0`` in an nn.Sequential, where ``0`` alone
    had been listed)."""
    parts = name.split(".")
    keep = 1
    while keep < len(parts) and parts[-keep].isdigit():
        keep += 1
    return ".".join(parts[-keep:])


def _natural(name: str) -> list[tuple[bool, int, str]]:
    """Sort key: ``net.2`` before ``net.11``."""
    return [(t.isdigit(), int(t) if t.isdigit() else 0, t) for t in name.split(".")]
