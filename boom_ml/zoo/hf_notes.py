"""The notes an hf: build adds to a prediction (``graph.model_notes``, ``Note:`` lines): what
the traced model is that the user did not name or that a GPU run would do otherwise."""

from __future__ import annotations

from typing import Any


def remote_code_note(config: Any, head: str) -> list[str]:
    """A config whose ``auto_map`` names the repo's own modelling code (trust_remote_code)
    is built from transformers' class for its model_type: say so, since that code is what
    the user's run would execute, and it may differ (fused kernels, other layouts)."""
    auto_map = getattr(config, "auto_map", None)
    if not isinstance(auto_map, dict) or not auto_map:
        return []
    hub_classes = sorted({str(v).split("--")[-1] for v in auto_map.values()})
    return [
        f"the config's auto_map names the repository's own code ({', '.join(hub_classes)}); "
        f"traced with transformers' {head} instead (that code is never run here)"
    ]


# Model types whose transformers classes run fused CUDA kernels where they are installed and
# a per-token scan in PyTorch otherwise: the trace, on the meta device, always takes the scan.
_MAMBA_KERNELS = "mamba-ssm, causal-conv1d"
SCAN_FALLBACK_KERNELS = {
    **{t: _MAMBA_KERNELS for t in ("mamba", "mamba2", "falcon_mamba", "jamba", "bamba", "zamba",
                                   "zamba2")},
    **{t: _MAMBA_KERNELS for t in ("falcon_h1", "nemotron_h", "granitemoehybrid")},
    "lfm2": "causal-conv1d",
    "rwkv": "its wkv CUDA kernel, compiled on first use",
}  # fmt: skip


def build_notes(config: Any, head: str, from_arch: bool) -> list[str]:
    """What the build chose that the user did not name: the repository's own code not run, a
    head other than the config's ``architectures`` says, a recurrent scan traced without its
    fused kernel."""
    notes = remote_code_note(config, head)
    archs = getattr(config, "architectures", None) or []
    if archs and not from_arch:
        notes.append(
            f"transformers has no class {archs[0]!r} (the config's architectures); traced as "
            f"{head}, the natural head of model_type {config.model_type!r}"
        )
    towers = [k for k in ("text_config", "vision_config", "audio_config")
              if getattr(config, k, None) is not None]  # fmt: skip
    if (
        not archs
        and "vision_config" in towers
        and len(towers) > 1
        and head.endswith("ForImageClassification")
    ):
        # CLIPConfig().save_pretrained() names no class: the image classifier had been traced
        # without its text tower, without a word (a hunt)
        notes.append(
            f"the config names no architectures: traced as {head}, the natural head of"
            f" model_type {config.model_type!r}, which builds its vision tower alone (not its"
            f" {', '.join(t for t in towers if t != 'vision_config')}); name the model's class"
            " in the config's architectures to trace another"
        )
    kernels = SCAN_FALLBACK_KERNELS.get(config.model_type)
    if kernels:
        notes.append(
            f"{config.model_type}'s scan traced as transformers' PyTorch loop over tokens; a GPU "
            f"run with its fused kernels ({kernels}) runs far fewer, larger kernels, so time "
            "and memory here are those of the slow path"
        )
    notes += quantization_note(config)
    return notes


def quantization_note(config: Any) -> list[str]:
    """A checkpoint quantized for inference or training (GPTQ, AWQ, FP8, bitsandbytes) is
    built as its float model here: say so (a GPTQ repo had been traced in fp32 without a
    word, a hunt)."""
    quant = getattr(config, "quantization_config", None)
    if not quant:
        return []
    fields = quant if isinstance(quant, dict) else getattr(quant, "__dict__", {})
    method = fields.get("quant_method") or "unnamed method"
    bits = fields.get("bits") or (4 if fields.get("load_in_4bit") else None)
    bits = bits or (8 if fields.get("load_in_8bit") else None)
    what = f"{method}" + (f", {bits}-bit" if bits else "")
    return [
        f"the config's quantization_config ({what}) is not modelled: the weights are traced in"
        " params_dtype, as its float model; finetune.method=qlora models bitsandbytes' 4-bit"
        " NF4 weights"
    ]


def attention_note(module: Any, asked: str, head: str) -> list[str]:
    """An architecture without the asked attention path (Gemma-2, GPT-Neo have no SDPA in
    transformers) is built with eager attention, as transformers runs it by default: say so.
    None for a model without attention modules (a Mamba's scan has no implementation)."""
    built = getattr(module.config, "_attn_implementation", None)
    if built is None or built == asked:
        return []
    if not has_attention(module):
        return []
    return [
        f"attention={asked}: transformers' {head} has no {asked} attention; traced with {built}"
        " attention, which transformers runs for it by default"
    ]


def has_attention(module: Any) -> bool:
    """Whether the model has attention modules (ConvNeXt, a Mamba have none: whatever
    implementation transformers records for them runs nothing)."""
    return any("Attention" in type(m).__name__ for m in module.modules())


def tied_head_note(asked: dict[str, Any], module: Any) -> list[str]:
    """A config that unties its output layer (``asked``: its fields as written, with the
    overrides, ``tie_word_embeddings: false``) built tied all the same (transformers 5's
    T5Config ties it whatever the config says: flan-t5): the checkpoint's own output layer is
    not in the trace, so say so (a hunt: flan-t5-base came out 222.9 M parameters, its card
    says 248 M, without a word)."""
    if asked.get("tie_word_embeddings") is not False:
        return []
    try:  # transformers raises for a class that has no embeddings (ConvNext)
        out, emb = module.get_output_embeddings(), module.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return []
    weight = getattr(emb, "weight", None)
    if out is None or weight is None or getattr(out, "weight", None) is not weight:
        return []
    return [
        f"the config unties the output layer (tie_word_embeddings: false), but transformers "
        f"builds {type(module).__name__} with it tied to the input embeddings, so the "
        f"checkpoint's own output layer ({out.weight.numel() / 1e6:.1f} M parameters, with "
        "its gradient and optimizer state) is not counted"
    ]
