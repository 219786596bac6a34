"""A size the model's inputs never read (a sequence length given to a CNN) is not part of the
step: the title leaves it out and a line says it was not used."""

from __future__ import annotations

from boom_ml.specs import StepSpec

SYNTHETIC_FILE_MODELS = """
import torch
import torch.nn as nn

class Tokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)

    def forward(self, x):
        return self.emb(x)

    def example_inputs(self, batch_size, device, seq_len=8):
        return {"x": torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)}

class Anything(Tokens):
    def example_inputs(self, batch_size, device, **kw):
        return {"x": torch.zeros(batch_size, kw.get("seq_len", 8), dtype=torch.long, device=device)}

def tokens():
    return Tokens()

def anything():
    return Anything()
"""


def test_file_models_read_the_sizes_example_inputs_takes(tmp_path) -> None:
    from boom_ml.zoo import build_model

    path = tmp_path / "m.py"
    path.write_text(SYNTHETIC_FILE_MODELS)
    step = StepSpec(batch_size=2, seq_len=16, image_size=32)
    tokens = build_model(f"file:{path}:tokens")
    assert tokens.reads == frozenset({"seq_len"})
    resolved = tokens.resolve_step(step)
    assert (resolved.seq_len, resolved.image_size) == (16, None)
    anything = build_model(f"file:{path}:anything")
    assert anything.reads is None  # **kwargs: any size may be read, both are kept
    resolved = anything.resolve_step(step)
    assert (resolved.seq_len, resolved.image_size) == (16, 32)


def test_a_cnn_given_a_sequence_length_says_it_was_not_used() -> None:
    import boom_ml
    from boom_ml.report.table import render_table

    pred = boom_ml.predict(model="torchvision:resnet18", gpu="l4", batch_size=2, image_size=32,
                           seq_len=512, advice=False, max_batch="off", cache=False)  # fmt: skip
    assert pred.step["seq_len"] is None and pred.step["image_size"] == 32
    assert pred.graph["unread"] == {"seq_len": 512}
    text = render_table(pred)
    assert "seq=512" not in text.splitlines()[0]
    assert "Not used: seq_len=512 (this model's inputs do not read it)" in text


def test_channels_last_on_a_model_without_convolutions_says_it_was_not_used() -> None:
    import boom_ml
    from boom_ml.report.table import render_table

    pred = boom_ml.predict(model="hf:gpt2", gpu="l4", batch_size=1, seq_len=32,
                           channels_last=True, advice=False, max_batch="off")  # fmt: skip
    assert pred.graph["unread"] == {"channels_last": True}
    assert (
        "Not used: channels_last=true (this model has no 2-D or 3-D convolutions)"
        in render_table(pred)
    )
    cnn = boom_ml.predict(model="torchvision:resnet18", gpu="l4", batch_size=2, image_size=32,
                          channels_last=True, advice=False, max_batch="off")  # fmt: skip
    assert cnn.graph["unread"] == {}
    # its fp32 convolutions are timed alike in either layout: said so (it had been silent)
    note = "channels_last=true changes nothing here: the step's convolutions are fp32 (TF32)"
    assert any(n.startswith(note) for n in cnn.graph["model_notes"])
    assert f"Note: {note}" in render_table(cnn)
    half = boom_ml.predict(model="torchvision:resnet18", gpu="l4", batch_size=2, image_size=32,
                           channels_last=True, amp="bf16", advice=False, max_batch="off")  # fmt: skip
    assert not any(n.startswith(note) for n in half.graph["model_notes"])


def test_checkpointing_every_without_checkpointing_says_it_was_not_used() -> None:
    import boom_ml
    from boom_ml.report.table import render_table

    kw = dict(model="torchvision:resnet18", gpu="l4", batch_size=2, image_size=32,
              checkpointing_every=2, advice=False, max_batch="off")  # fmt: skip
    pred = boom_ml.predict(**kw)
    assert pred.graph["unread"] == {"checkpointing.every": 2}
    text = render_table(pred)
    assert "Not used: checkpointing.every=2 (checkpointing=none checkpoints no block)" in text
    # a small step's work in GFLOP, not "0.00 TFLOP"
    assert " GFLOP per step" in text and "0.00 TFLOP" not in text
    assert boom_ml.predict(**kw, checkpointing="full").graph["unread"] == {}


def test_an_optimizer_implementation_without_an_optimizer_says_it_was_not_used() -> None:
    """optimizer=none with optimizer.impl=fused ran silently (a hunt's finding)."""
    import boom_ml
    from boom_ml.report.table import render_table

    kw = dict(model="torchvision:resnet18", gpu="l4", batch_size=2, image_size=32,
              optimizer="none", advice=False, max_batch="off")  # fmt: skip
    pred = boom_ml.predict(**kw, optimizer_impl="fused")
    assert pred.graph["unread"] == {"optimizer.impl": "fused"}
    assert "Not used: optimizer.impl=fused (optimizer=none runs no optimizer)" in render_table(pred)
    assert boom_ml.predict(**kw).graph["unread"] == {}


def test_channels_last_leaves_a_conv1d_models_transforms(tmp_path) -> None:
    """channels_last exists for 4-D and 5-D tensors only: an audio net of Conv1d layers under
    fp16 autocast had come out faster with channels_last=true, its convolutions' NCHW
    transforms dropped (a hunt). Its time is the same either way, and the key is said unused."""
    import boom_ml

    path = tmp_path / "audio.py"
    path.write_text(
        "import torch\nfrom torch import nn\n\n\ndef make():\n"
        "    return nn.Sequential(nn.Conv1d(1, 32, 5, padding=2), nn.GELU(),"
        " nn.Conv1d(32, 64, 5, padding=2))\n\n\n"
        "def example_inputs(batch_size, device):\n"
        "    return torch.randn(batch_size, 1, 4000, device=device)\n"
    )
    times = {}
    for layout in (False, True):
        pred = boom_ml.predict(model=f"file:{path}:make", gpu="a100-80gb-sxm", batch_size=8,
                               amp="fp16", channels_last=layout, advice=False,
                               max_batch="off")  # fmt: skip
        times[layout] = pred.gpus[0].time.per_op_ms
    assert times[True] == times[False]
    assert pred.graph["unread"] == {"channels_last": True}
    # and no note that autocast would make it help (the review found one)
    assert not any("channels_last" in note for note in pred.graph["model_notes"])
