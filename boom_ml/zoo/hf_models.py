"""``hf:<id-or-path>``: Hugging Face transformers built from a config, never with weights.

The config is one of the configs shipped in ``hf_configs/`` (``<org>--<name>.json``), a
local ``config.json`` (or a folder holding one), or a hub id's ``config.json`` from the
local Hugging Face cache or downloaded alone (``hf_hub``). The model class is the config's
``architectures[0]``; without one, the natural head for the config (seq2seq LM, masked
LM, causal LM, image classifier, else the bare model).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any

import torch
from torch import nn

from boom_ml.errors import BoomError, InvalidInputError, last_line
from boom_ml.hf_shipped import lookup as _lookup
from boom_ml.hf_shipped import shipped
from boom_ml.specs import ATTENTION_CHOICES, ModelSpec, StepSpec, check_choice
from boom_ml.zoo.base import BuiltModel
from boom_ml.zoo.common import build_on_device, generic_loss
from boom_ml.zoo.hf_config import config_path, load_config, read_config
from boom_ml.zoo.hf_longformer import patch_local_attention
from boom_ml.zoo.hf_moe import DEFAULT_IMBALANCE, patch_moe
from boom_ml.zoo.hf_notes import attention_note, build_notes, has_attention, tied_head_note

# Default sequence lengths: encoders are trained at <= 512, decoders at >= 1024 (GPT-2's limit).
ENCODER_SEQ_LEN = 512
DECODER_SEQ_LEN = 2048
# Answers per question for ...ForMultipleChoice heads: SWAG, RACE, ARC and MMLU have 4.
MULTIPLE_CHOICES = 4


def safe_name(model_id: str) -> str:
    """File stem of a shipped config: ``meta-llama/Llama-3.2-1B`` -> ``meta-llama--Llama-3.2-1B``."""
    return model_id.replace("/", "--")


@functools.cache
def names() -> tuple[str, ...]:
    return tuple(shipped())


def has(name: str) -> bool:
    """Shipped ids only: a bare name never means a file path."""
    return _lookup(name) is not None


def _in_mapping(mapping: Any, config: Any) -> bool:
    try:
        return type(config) in mapping
    except Exception:  # lazy mappings import model code; treat any failure as absent
        return False


def model_class(config: Any) -> tuple[type, bool]:
    """(class, from_architectures): ``architectures[0]`` when transformers has it."""
    import transformers
    from transformers.models.auto import modeling_auto as auto

    archs = getattr(config, "architectures", None) or []
    if (
        archs
        and isinstance(archs[0], str)
        and isinstance(getattr(transformers, archs[0], None), type)
    ):
        return getattr(transformers, archs[0]), True
    # No (known) architecture: the natural head. Order matters: BERT also has a causal
    # head (BertLMHeadModel), but masked LM is what it is trained with.
    for mapping in (
        auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING if config.is_encoder_decoder else {},
        auto.MODEL_FOR_MASKED_LM_MAPPING,
        auto.MODEL_FOR_CAUSAL_LM_MAPPING,
        auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING,
        auto.MODEL_MAPPING,
    ):
        if _in_mapping(mapping, config):
            return mapping[type(config)], False
    raise InvalidInputError(f"transformers has no model class for model_type {config.model_type!r}")


@functools.cache
def _dtype_keyword() -> str:
    """transformers 4.56 renamed ``torch_dtype`` to ``dtype``; older ones reject the new name."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def _instantiate(cls: type, config: Any, attention: str = "sdpa") -> nn.Module:
    # fp32 master weights whatever the config's dtype: AMP casts at run time.
    fp32 = {_dtype_keyword(): torch.float32}
    try:
        return cls._from_config(config, attn_implementation=attention, **fp32)
    except ValueError as err:
        # Architectures without an SDPA path (GPT-Neo, ...) say so; they train with eager.
        text = str(err).lower()
        if attention != "sdpa" or (
            "sdpa" not in text and "scaled_dot_product_attention" not in text
        ):
            raise
        return cls._from_config(config, attn_implementation="eager", **fp32)


def split_options(options: dict[str, Any]) -> tuple[dict[str, Any], str, float]:
    """(config overrides, attention implementation, MoE imbalance) from ModelSpec options.

    ``attn_implementation`` ("sdpa", the default, or "eager") and ``moe_imbalance`` (>= 1.0)
    are build options; every other key overrides a config field.
    """
    overrides = dict(options)
    attention = str(overrides.pop("attn_implementation", "sdpa"))
    check_choice("attention", attention, ATTENTION_CHOICES)
    try:
        imbalance = float(overrides.pop("moe_imbalance", DEFAULT_IMBALANCE))
    except (TypeError, ValueError) as err:
        raise InvalidInputError(f"moe_imbalance must be a number >= 1.0: {err}") from err
    return overrides, attention, imbalance


def _rope(config: Any) -> bool:
    return bool(getattr(config, "rope_parameters", None) or getattr(config, "rope_theta", None))


def _no_layerdrop(config: Any) -> dict[str, float]:
    """Turn LayerDrop off in ``config``; returns the probabilities it had (``{}``: none).

    With LayerDrop (M2M100 / NLLB, Wav2Vec2, XGLM, ...) each layer draws ``torch.rand([])``
    and is skipped below ``layerdrop``: a branch on a value fake tensors do not have. The
    trace is the step that skips no layer, every layer's memory and time: the peak a GPU
    reaches whenever a step drops none (probability ``(1 - p) ** layers``).
    """
    dropped = {}
    for key, value in config.to_dict().items():
        if key.endswith("layerdrop") and isinstance(value, (int, float)) and value > 0:
            setattr(config, key, 0.0)
            dropped[key] = float(value)
    return dropped


def _sequence_classifier(config: Any) -> None:
    """A sequence classifier's pad token and problem type, where its config has none.

    A pad token (Llama, Mistral, Qwen...): decoder classifiers pool the last non-pad token and refuse batches over 1 without a
    pad token; fine-tuning recipes set it to the EOS token (``config.pad_token_id =
    tokenizer.eos_token_id``), and so does the zoo. Set after the build: the embedding's
    padding_idx stays as the config says.
    """
    if getattr(config, "pad_token_id", None) is None:
        eos = getattr(config, "eos_token_id", None)
        config.pad_token_id = (eos[0] if eos else 0) if isinstance(eos, list) else (eos or 0)
    # The zoo's labels are one class index per sample: say so. Without it DeBERTa's loss
    # drops negative labels with nonzero(), a shape fake tensors cannot know; the other
    # classifiers infer the same problem type from integer labels.
    if getattr(config, "problem_type", None) is None and getattr(config, "num_labels", 2) > 1:
        config.problem_type = "single_label_classification"


def _classifier_labels(config: Any, num_labels: int, batch: int, dev: torch.device) -> Any:
    """A sequence classifier's targets as its ``problem_type`` reads them: a class index per
    sample, a multi-hot row of ``num_labels`` floats (multi-label: BCE with logits), or float
    targets (regression: one per sample, or one per label). Class indices alone had been made,
    which multi-label and regression checkpoints (emotion, toxicity classifiers) refuse in
    their loss (a hunt)."""
    problem = getattr(config, "problem_type", None)
    if problem == "multi_label_classification":
        return torch.randint(0, 2, (batch, num_labels), device=dev).float()
    if problem == "regression" or (problem is None and num_labels == 1):
        return torch.randn((batch, num_labels) if num_labels > 1 else (batch,), device=dev)
    return torch.randint(0, num_labels, (batch,), device=dev)


# Config fields that give a MoE model's expert count (Mixtral; Qwen-MoE; DeepSeek; DBRX's
# ffn_config holds moe_num_experts)
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def _has_experts(config: Any) -> bool:
    """Whether the config describes experts, even where a cut of it has none built (a
    pipeline rank's first layers of DeepSeek are dense: ``first_k_dense_replace``)."""
    ffn = getattr(config, "ffn_config", None)
    return any((getattr(config, k, 0) or getattr(ffn, k, 0) or 0) > 1 for k in _EXPERT_KEYS)


def build(spec: ModelSpec, name: str, device: str | torch.device = "meta") -> BuiltModel:
    overrides, attention, imbalance = split_options(spec.options)
    path = config_path(name)
    raw = read_config(path)  # as written: transformers may override what it says (tied_head_note)
    config = load_config(path, overrides, raw)
    # A training step keeps no KV cache (checkpointing turns it off anyway): the same
    # graph with and without recomputation.
    if hasattr(config, "use_cache"):
        config.use_cache = False
    on_meta = torch.device(device).type == "meta"
    layerdrop = _no_layerdrop(config) if on_meta else {}
    cls, from_arch = model_class(config)
    what = f"hf:{name}"
    try:
        module = build_on_device(lambda: _instantiate(cls, config, attention), device)
    except (BoomError, torch.cuda.OutOfMemoryError):  # a measurement's build OOM stays one
        raise
    except (ValueError, TypeError, AttributeError) as err:
        raise InvalidInputError(f"{what}: cannot build {cls.__name__}: {err}") from err
    except Exception as err:  # noqa: BLE001 - a config transformers accepts but cannot build
        raise InvalidInputError(
            f"{what}: cannot build {cls.__name__}: {type(err).__name__}: {last_line(err)}"
        ) from err
    # Fake tensors cannot answer which tokens a router picks: route evenly (hf_moe). A model
    # built on a real device for a measurement keeps transformers' routing.
    moe_layers = patch_moe(module, imbalance) if on_meta else 0
    if on_meta and not moe_layers and imbalance != DEFAULT_IMBALANCE and not _has_experts(config):
        raise InvalidInputError(
            f"moe.imbalance={imbalance:g}: hf:{name} has no mixture-of-experts layers the zoo "
            "routes, so there is no expert load to skew; leave moe.imbalance out"
        )
    if on_meta:  # Longformer / LED: no global attention in the zoo's inputs (hf_longformer)
        patch_local_attention(module)

    signature = inspect.signature(module.forward).parameters
    params = set(signature)
    head = cls.__name__
    if head.endswith("ForSequenceClassification"):
        _sequence_classifier(module.config)
    vision = "pixel_values" in params and "input_ids" not in params
    # Whisper: 30 s of log-mel frames into the encoder, seq_len decoder tokens
    speech = config.model_type == "whisper" and "input_features" in params
    if "input_ids" not in params and not vision and not speech:
        main = next(iter(signature), "?")
        raise InvalidInputError(
            f"{what}: {head} takes {main!r} inputs, which the hf zoo cannot make: it makes "
            "input_ids (text), pixel_values (images) and Whisper's input_features only"
        )
    seq2seq = bool(getattr(config, "is_encoder_decoder", False))
    if seq2seq and head.endswith("ForSequenceClassification"):
        # BART / T5 families: hidden_states[input_ids == eos] and a check that every
        # sample has as many EOS tokens, shapes that depend on the token values
        raise InvalidInputError(
            f"{what}: {head} pools at the EOS tokens it finds by value (a data-dependent "
            "shape fake tensors cannot trace); use its ForConditionalGeneration head"
        )
    decoder = not seq2seq and (
        head.endswith(("ForCausalLM", "LMHeadModel")) or bool(getattr(config, "is_decoder", False))
    )
    max_pos = getattr(config, "max_position_embeddings", None)
    if speech:  # the decoder's learned positions (the encoder's are fixed at 30 s)
        max_pos = getattr(config, "max_target_positions", None)
    if vision:
        seq_default = None
    elif decoder:
        seq_default = min(max_pos or DECODER_SEQ_LEN, DECODER_SEQ_LEN)
    else:
        seq_default = min(max_pos or ENCODER_SEQ_LEN, ENCODER_SEQ_LEN)
    # Learned absolute positions cannot index past their table (fake tensors would not
    # notice, a GPU would); rotary models extrapolate, so they get no limit.
    seq_limit = max_pos if max_pos and not _rope(config) else None
    # RoBERTa's family numbers positions from padding_idx + 1 (transformers'
    # create_position_ids_from_input_ids): two fewer than its table (a hunt: 514 had traced)
    start = next((int(m.padding_idx) + 1 for m in module.modules()
                  if hasattr(type(m), "create_position_ids_from_input_ids")
                  and isinstance(getattr(m, "padding_idx", None), int)), 0)  # fmt: skip
    if seq_limit is not None:
        seq_limit -= start
        seq_default = min(seq_default, seq_limit) if seq_default else seq_default
    image_size = int(getattr(config, "image_size", 224)) if vision else None
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if not vision and not speech and vocab <= 0:  # randint(0, 0) had been the error (a hunt)
        # a text-and-image model: the cause first (it had come after the symptom: a hunt)
        raise InvalidInputError(
            f"{what}: {head} takes text and images together (input_ids and pixel_values), which"
            " the hf zoo does not make: it makes text or images alone"
            if "pixel_values" in params
            else f"{what}: {head} has no vocab_size at its config's top level"
        )
    num_labels = int(getattr(config, "num_labels", 2))

    def make_inputs(step: StepSpec, dev: torch.device) -> dict[str, Any]:
        b = step.batch_size
        if vision:
            size = step.image_size or image_size
            if size != image_size and "interpolate_pos_encoding" in params:
                # ViT-like: HF refuses another size unless its position table is interpolated
                raise InvalidInputError(
                    f"{what}: its position embeddings are for {image_size}-pixel images (config"
                    f" image_size); give model_options.image_size={size} to build it at that size"
                )
            chans = int(getattr(config, "num_channels", 3))
            batch: dict[str, Any] = {"pixel_values": torch.randn(b, chans, size, size, device=dev)}
            if "labels" in params:
                # a segmentation head takes a class per pixel (its loss upsamples the logits to
                # them; one label per image had failed in interpolate, a hunt)
                shape = (b, size, size) if head.endswith("ForSemanticSegmentation") else (b,)
                batch["labels"] = torch.randint(0, num_labels, shape, device=dev)
            return batch
        seq = step.seq_len or seq_default
        if seq_limit is not None and seq > seq_limit:
            raise InvalidInputError(
                f"{what}: seq_len {seq} exceeds its {seq_limit} learned positions"
                + (f" (numbered from padding_idx + 1 = {start})" if start else "")
            )
        if speech:
            # Whisper's encoder takes exactly 2 x max_source_positions mel frames (two
            # convolutions, the second of stride 2: 3000 frames, 30 s, for 1500 positions)
            frames = 2 * int(config.max_source_positions)
            mels = int(config.num_mel_bins)
            return {
                "input_features": torch.randn(b, mels, frames, device=dev),
                "labels": torch.randint(0, vocab, (b, seq), device=dev),
            }
        if head.endswith("ForMultipleChoice"):
            # each sample is MULTIPLE_CHOICES sequences (question + one answer each), one label
            shape = (b, MULTIPLE_CHOICES, seq)
            return {
                "input_ids": torch.randint(0, vocab, shape, device=dev),
                "labels": torch.randint(0, MULTIPLE_CHOICES, (b,), device=dev),
            }
        batch = {"input_ids": torch.randint(0, vocab, (b, seq), device=dev)}
        if "labels" in params:
            if head.endswith("ForSequenceClassification"):
                batch["labels"] = _classifier_labels(config, num_labels, b, dev)
            elif head.endswith("ForNextSentencePrediction"):  # is B the sentence after A?
                batch["labels"] = torch.randint(0, 2, (b,), device=dev)
            elif head.endswith("ForTokenClassification"):
                batch["labels"] = torch.randint(0, num_labels, (b, seq), device=dev)
            else:  # language-model heads: one target token per position
                batch["labels"] = torch.randint(0, vocab, (b, seq), device=dev)
        if "next_sentence_label" in params:  # BertForPreTraining's second objective
            batch["next_sentence_label"] = torch.randint(0, 2, (b,), device=dev)
        if "start_positions" in params:  # question answering
            batch["start_positions"] = torch.randint(0, seq, (b,), device=dev)
            batch["end_positions"] = torch.randint(0, seq, (b,), device=dev)
        return batch

    def compute_loss(outputs: Any, inputs: dict[str, Any]) -> torch.Tensor:
        loss = getattr(outputs, "loss", None)
        return loss if isinstance(loss, torch.Tensor) else generic_loss(outputs, inputs)

    def enable_checkpointing(m: nn.Module) -> None:
        if not getattr(m, "supports_gradient_checkpointing", False):
            raise InvalidInputError(f"{what}: {type(m).__name__} does not support checkpointing")
        # transformers 5 renamed the method and warns on every call: not the user's concern
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    return BuiltModel(
        spec=spec,
        module=module,
        family="transformer",
        make_inputs=make_inputs,
        compute_loss=compute_loss,
        enable_checkpointing=enable_checkpointing,
        default_seq_len=seq_default,
        default_image_size=image_size,
        reads=frozenset({"image_size" if vision else "seq_len"}),
        source="hf",
        info={
            "name": name,
            "config_path": str(path),
            "model_type": config.model_type,
            "class": head,
            "class_from_architectures": from_arch,
            "vocab_size": vocab or None,
            "max_positions": max_pos,
            # none where nothing attends (ConvNeXt's header had said attn=eager; a hunt)
            "attn_implementation": getattr(module.config, "_attn_implementation", None)
            if has_attention(module)
            else None,
            "moe_layers": moe_layers,
            "moe_imbalance": imbalance if moe_layers else None,
            "layerdrop_off": layerdrop or None,  # the config's LayerDrop, not traced
            "notes": build_notes(config, head, from_arch)
            + attention_note(module, attention, head)
            + tied_head_note({**raw, **overrides}, module),
        },
    )
