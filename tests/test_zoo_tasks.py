"""torchvision segmentation and video models: built without downloads, fed and scored as their
reference training does, sized by what their weights record, traced end to end."""

from __future__ import annotations

import json

import pytest
import torch

from boom_ml.specs import ModelSpec, StepSpec
from boom_ml.trace.step import trace_step
from boom_ml.zoo import build_model, list_models, resolve_name
from boom_ml.zoo.torchvision_tasks import clip_length, segmentation_loss

CPU = torch.device("cpu")


def test_names_and_sizes_come_from_torchvision() -> None:
    listed = list_models("torchvision")
    for name in ("deeplabv3_resnet50", "lraspp_mobilenet_v3_large", "r3d_18", "mvit_v2_s"):
        assert f"torchvision:{name}" in listed
    assert resolve_name("r3d_18") == "torchvision:r3d_18"
    # the weights' records: segmentation evaluated at 520, Kinetics clips of 16 / 32 frames
    deeplab = build_model("torchvision:deeplabv3_resnet50")
    assert deeplab.default_image_size == 520 and deeplab.info["num_classes"] == 21
    r3d = build_model("torchvision:r3d_18")
    assert (r3d.default_image_size, r3d.default_seq_len, r3d.info["num_classes"]) == (112, 16, 400)
    assert clip_length("swin3d_t") == 32 and clip_length("s3d") == 128
    assert build_model("torchvision:mvit_v2_s").default_image_size == 224


def test_segmentation_batch_and_loss() -> None:
    built = build_model(ModelSpec("torchvision:fcn_resnet50", {"aux_loss": True}))
    batch = built.make_inputs(StepSpec(batch_size=2, image_size=32), CPU)
    assert batch["x"].shape == (2, 3, 32, 32)
    assert batch["_target"].shape == (2, 32, 32) and batch["_target"].dtype == torch.int64
    logits = torch.zeros(2, 21, 32, 32)  # uniform: cross-entropy log(21) per pixel
    target = {"_target": torch.zeros(2, 32, 32, dtype=torch.long)}
    ce = torch.log(torch.tensor(21.0))
    assert torch.isclose(segmentation_loss({"out": logits}, target), ce)
    both = segmentation_loss({"out": logits, "aux": logits}, target)
    assert torch.isclose(both, 1.5 * ce)  # out + 0.5 aux
    void = {"_target": torch.full((2, 32, 32), 255, dtype=torch.long)}
    void["_target"][0, 0, 0] = 0  # every other pixel ignored
    assert torch.isclose(segmentation_loss({"out": logits}, void), ce)


def test_lraspp_takes_its_own_argument_name() -> None:
    built = build_model("torchvision:lraspp_mobilenet_v3_large")
    assert set(built.make_inputs(StepSpec(batch_size=1, image_size=32), CPU)) == {
        "input",
        "_target",
    }


def test_video_trace_follows_frames_and_size() -> None:
    built = build_model("torchvision:r3d_18")
    graph = trace_step(built, StepSpec(batch_size=2, seq_len=4, image_size=32, optimizer="none"))
    first_conv = graph.nodes[graph.nodes.family == "conv"].iloc[0]
    assert json.loads(first_conv.input_shapes)[0] == [2, 3, 4, 32, 32]  # (B, 3, frames, H, W)
    assert graph.meta["step"]["seq_len"] == 4 and graph.meta["step"]["image_size"] == 32
    loss = graph.nodes[graph.nodes.phase == "loss"]
    assert "nll_loss_forward" in set(loss.op)


def test_segmentation_trace_with_aux_head_sums_two_losses() -> None:
    spec = ModelSpec("torchvision:deeplabv3_mobilenet_v3_large", {"aux_loss": True})
    graph = trace_step(build_model(spec), StepSpec(batch_size=2, image_size=64, optimizer="none"))
    loss = graph.nodes[graph.nodes.phase == "loss"]
    assert (loss.op == "nll_loss2d_forward").sum() == 2  # out and aux, per pixel
    assert json.loads(loss[loss.op == "nll_loss2d_forward"].iloc[0].input_shapes)[0] == [
        2,
        21,
        64,
        64,
    ]


def test_detection_error_is_one_line() -> None:
    from boom_ml.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="data-dependent sizes"):
        build_model("torchvision:retinanet_resnet50_fpn")
    # a bare name finds torchvision's model and its reason, not "unknown model"
    assert resolve_name("fasterrcnn_resnet50_fpn") == "torchvision:fasterrcnn_resnet50_fpn"


def test_clip_sizes_the_model_cannot_take_are_one_line() -> None:
    from boom_ml.errors import InvalidInputError

    mvit = build_model("torchvision:mvit_v2_s")  # positional encodings for 16 x 224 x 224
    assert (mvit.default_seq_len, mvit.default_image_size) == (16, 224)
    with pytest.raises(InvalidInputError, match="built for clips of 16 frames of 224x224"):
        mvit.make_inputs(StepSpec(batch_size=1, seq_len=8), CPU)
    s3d = build_model("torchvision:s3d")  # its weights: at least 14 frames
    with pytest.raises(InvalidInputError, match="at least 14 frames"):
        s3d.make_inputs(StepSpec(batch_size=1, seq_len=8, image_size=32), CPU)
    assert s3d.make_inputs(StepSpec(batch_size=1, seq_len=14, image_size=32), CPU)["x"].shape == (
        1,
        3,
        14,
        32,
        32,
    )
