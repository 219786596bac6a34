"""The Hugging Face zoo's heads and inputs beyond the plain LM: local attention, audio
features, LayerDrop, sequence classification, multiple choice (synthetic tiny configs)."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch._subclasses.fake_tensor import FakeTensorMode
from zoo_helpers import CPU, fake_step, tiny_config

from boom_ml.errors import InvalidInputError
from boom_ml.specs import StepSpec
from boom_ml.zoo import build_model


@pytest.mark.parametrize(
    ("model_type", "arch", "fields"),
    [
        (
            "longformer",
            "LongformerForMaskedLM",
            {"num_hidden_layers": 1, "max_position_embeddings": 130, "attention_window": 16},
        ),
        (
            "led",
            "LEDForConditionalGeneration",
            {"encoder_layers": 1, "decoder_layers": 1, "attention_window": 16},
        ),
    ],
)
def test_longformer_encoders_trace_with_local_attention(
    tmp_path: Path, model_type: str, arch: str, fields: dict
) -> None:
    """Longformer / LED ask ``.item()`` whether any token attends globally: fake tensors
    failed (DataDependentOutputException on aten._local_scalar_dense); the zoo's inputs
    have no global attention, so the encoder now answers False and traces the local path."""
    small = {"vocab_size": 100, "hidden_size": 32, "d_model": 32, "intermediate_size": 64}
    small |= {"num_attention_heads": 2, "encoder_attention_heads": 2}
    small |= {"decoder_attention_heads": 2, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64}
    name = tiny_config(tmp_path, model_type, arch, **small, **fields)
    built = build_model(name)
    assert type(built.module).__name__ == arch
    with FakeTensorMode(allow_non_fake_inputs=True):
        built.materialize("cpu")
        built.module.train()
        built.enable_checkpointing(built.module)
        batch = built.make_inputs(built.resolve_step(StepSpec(batch_size=2, seq_len=40)), CPU)
        loss = built.compute_loss(built.module(**built.forward_kwargs(batch)), batch)
        loss.backward()  # seq_len 40: padded to 48, a multiple of the window
    # only the global-attention projections idle, as on a GPU for these inputs
    idle = {n.split(".")[-2] for n, p in built.module.named_parameters() if p.grad is None}
    assert idle == {"query_global", "key_global", "value_global"}


def test_whisper_traces_on_log_mel_features(tmp_path: Path) -> None:
    """Whisper failed in its encoder ('NoneType' object has no attribute 'shape': the zoo
    gave it input_ids); it now gets 2 x max_source_positions mel frames and seq_len labels."""
    small = {"d_model": 32, "encoder_layers": 1, "decoder_layers": 1, "vocab_size": 100}
    small |= {"encoder_attention_heads": 2, "decoder_attention_heads": 2}
    small |= {"encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "num_mel_bins": 8}
    small |= {"max_source_positions": 16, "max_target_positions": 24}
    small |= {"decoder_start_token_id": 1, "pad_token_id": 2, "bos_token_id": 1}
    small |= {"eos_token_id": 2}
    built = build_model(
        tiny_config(tmp_path, "whisper", "WhisperForConditionalGeneration", **small)
    )
    batch = fake_step(built, StepSpec(batch_size=2, seq_len=12), checkpointing=True)
    assert batch["input_features"].shape == (2, 8, 32) and batch["labels"].shape == (2, 12)
    assert built.default_seq_len == 24  # the decoder's learned positions
    with pytest.raises(InvalidInputError, match="24 learned positions"):
        built.make_inputs(StepSpec(batch_size=1, seq_len=25), CPU)


def test_raw_audio_model_is_a_one_line_error(tmp_path: Path) -> None:
    """Wav2Vec2 takes raw audio (input_values): it failed mid-trace with a TypeError about
    a missing argument; the build now says which input the zoo cannot make."""
    small = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    small |= {"intermediate_size": 64, "vocab_size": 32, "conv_dim": [8], "conv_kernel": [4]}
    small |= {"conv_stride": [2], "num_conv_pos_embeddings": 4}
    small |= {"num_conv_pos_embedding_groups": 2}
    name = tiny_config(tmp_path, "wav2vec2", "Wav2Vec2ForCTC", **small)
    with pytest.raises(InvalidInputError, match="takes 'input_values' inputs"):
        build_model(name)


def test_layerdrop_is_traced_as_the_step_that_drops_no_layer(tmp_path: Path) -> None:
    """M2M100 (NLLB-200's type) draws torch.rand([]) per layer for LayerDrop: the branch
    failed on fake tensors (DataDependentOutputException on aten._local_scalar_dense); the
    meta build now turns LayerDrop off (every layer runs) and records what it was."""
    small = {"d_model": 32, "encoder_layers": 1, "decoder_layers": 1, "vocab_size": 100}
    small |= {"encoder_attention_heads": 2, "decoder_attention_heads": 2}
    small |= {"encoder_ffn_dim": 64, "decoder_ffn_dim": 64}
    small |= {"encoder_layerdrop": 0.05, "decoder_layerdrop": 0.1}
    name = tiny_config(tmp_path, "m2m_100", "M2M100ForConditionalGeneration", **small)
    built = build_model(name)
    assert built.info["layerdrop_off"] == {"encoder_layerdrop": 0.05, "decoder_layerdrop": 0.1}
    fake_step(built, StepSpec(batch_size=2, seq_len=16), checkpointing=True)
    assert build_model("hf:t5-small").info["layerdrop_off"] is None


def test_decoder_sequence_classifier_without_pad_token(tmp_path: Path) -> None:
    """LlamaForSequenceClassification from a Llama config (no pad_token_id) failed for
    batch_size > 1 ('Cannot handle batch sizes > 1 if no padding token is defined'); the
    zoo now pads with the EOS token, as fine-tuning recipes do."""
    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
    small |= {"num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 100}
    small |= {"eos_token_id": 7, "bos_token_id": 1, "pad_token_id": None}
    name = tiny_config(tmp_path, "llama", "LlamaForSequenceClassification", **small)
    built = build_model(name)
    assert built.module.config.pad_token_id == 7
    assert built.module.model.embed_tokens.padding_idx is None  # the build is unchanged
    batch = fake_step(built, StepSpec(batch_size=2, seq_len=16))
    assert batch["labels"].shape == (2,)


def test_deberta_sequence_classifier(tmp_path: Path) -> None:
    """DeBERTa-v2's classification loss without a problem_type failed (DynamicOutputShape-
    Exception on aten.nonzero: it drops negative labels); the zoo's labels are class
    indices, so the problem type is now single-label classification."""
    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
    small |= {"num_attention_heads": 2, "vocab_size": 100}
    name = tiny_config(tmp_path, "deberta-v2", "DebertaV2ForSequenceClassification", **small)
    built = build_model(name)
    assert built.module.config.problem_type == "single_label_classification"
    fake_step(built, StepSpec(batch_size=2, seq_len=16))


@pytest.mark.parametrize(
    ("problem", "labels", "shape", "floats"),
    [("multi_label_classification", 5, (2, 5), True), ("regression", 3, (2, 3), True),
     (None, 1, (2,), True), ("single_label_classification", 5, (2,), False)],
)  # fmt: skip
def test_a_sequence_classifier_gets_the_targets_of_its_problem_type(
    tmp_path: Path, problem: str | None, labels: int, shape: tuple, floats: bool
) -> None:
    """Multi-label checkpoints (emotion, toxicity classifiers) and regression heads got class
    indices and failed in their loss ("Target size (torch.Size([2])) must be the same as input
    size (torch.Size([2, 5]))", a hunt): multi-hot rows and float targets now; one label
    without a problem type is transformers' regression."""
    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
    small |= {"num_attention_heads": 2, "vocab_size": 100, "num_labels": labels}
    if problem is not None:
        small["problem_type"] = problem
    built = build_model(tiny_config(tmp_path, "bert", "BertForSequenceClassification", **small))
    batch = fake_step(built, StepSpec(batch_size=2, seq_len=16))
    assert batch["labels"].shape == shape and batch["labels"].is_floating_point() == floats


@pytest.mark.parametrize(
    ("arch", "ids_shape"),
    [("BertForMultipleChoice", (2, 4, 16)), ("BertForNextSentencePrediction", (2, 16))],
)
def test_bert_multiple_choice_and_next_sentence_heads(
    tmp_path: Path, arch: str, ids_shape: tuple
) -> None:
    """BertForMultipleChoice got (batch, seq) tokens ("shape '[-1, 16]' is invalid") and
    BertForNextSentencePrediction per-token labels ("Expected input batch_size (2) to
    match target batch_size (32)"); they now get 4 choices per sample and one label each."""
    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
    small |= {"num_attention_heads": 2, "vocab_size": 100}
    built = build_model(tiny_config(tmp_path, "bert", arch, **small))
    batch = fake_step(built, StepSpec(batch_size=2, seq_len=16))
    assert batch["input_ids"].shape == ids_shape and batch["labels"].shape == (2,)


def test_seq2seq_sequence_classifier_is_a_one_line_error(tmp_path: Path) -> None:
    """BartForSequenceClassification failed mid-trace with 'DynamicOutputShapeException:
    aten.unique_consecutive.default'; the build now says why in one line."""
    small = {"d_model": 32, "encoder_layers": 1, "decoder_layers": 1, "vocab_size": 100}
    small |= {"encoder_attention_heads": 2, "decoder_attention_heads": 2}
    small |= {"encoder_ffn_dim": 64, "decoder_ffn_dim": 64}
    name = tiny_config(tmp_path, "bart", "BartForSequenceClassification", **small)
    with pytest.raises(InvalidInputError, match="EOS tokens it finds by value"):
        build_model(name)


def test_a_segmentation_head_gets_a_label_per_pixel(tmp_path: Path) -> None:
    """A hunt: SegformerForSemanticSegmentation got one label per image and failed in its
    loss's interpolate; it takes a class per pixel."""
    spec = tiny_config(tmp_path, "segformer", "SegformerForSemanticSegmentation",
                       hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1],
                       num_attention_heads=[1, 1, 2, 2], decoder_hidden_size=16, num_labels=5)  # fmt: skip
    batch = fake_step(build_model(spec), StepSpec(batch_size=2, image_size=32))
    assert tuple(batch["labels"].shape) == (2, 32, 32)


def test_a_text_and_image_config_without_a_class_says_it_traces_the_image_tower(tmp_path):
    """CLIPConfig().save_pretrained() names no architectures: transformers' natural head for it
    is the image classifier, which builds the vision tower alone; it had been traced so without
    a word (a hunt). With its class named, no note. Synthetic small config."""
    from transformers import CLIPConfig

    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
             "num_attention_heads": 2}  # fmt: skip
    config = CLIPConfig(text_config=small, vision_config={**small, "image_size": 32,
                                                          "patch_size": 8})  # fmt: skip
    config.save_pretrained(tmp_path)
    (note,) = build_model(f"hf:{tmp_path / 'config.json'}").info["notes"]
    assert note == (
        "the config names no architectures: traced as CLIPForImageClassification, the natural"
        " head of model_type 'clip', which builds its vision tower alone (not its text_config);"
        " name the model's class in the config's architectures to trace another"
    )
    config.architectures = ["CLIPForImageClassification"]
    config.save_pretrained(tmp_path)
    assert build_model(f"hf:{tmp_path / 'config.json'}").info["notes"] == []
