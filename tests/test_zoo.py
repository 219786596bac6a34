"""The model zoo: naming, building on meta, synthesised inputs, losses, checkpointing."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from zoo_helpers import CPU, all_on_meta, fake_step

from boom_ml.errors import InvalidInputError, UnknownModelError
from boom_ml.specs import ModelSpec, StepSpec
from boom_ml.zoo import build_model, list_models, resolve_name
from boom_ml.zoo.checkpointing import find_blocks

USER_FILE = """
import torch
from dataclasses import dataclass
from torch import nn


@dataclass
class Cfg:  # dataclasses need the module registered in sys.modules
    width: int = 8


class Net(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.blocks = nn.Sequential(
            *[nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.ReLU()) for _ in range(3)]
        )
        self.head = nn.Linear(width, 10)

    def forward(self, img):
        return self.head(self.blocks(self.stem(img)).mean((2, 3)))


class Tok(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 16)
        self.out = nn.Linear(16, 100)

    def forward(self, ids):
        return self.out(self.emb(ids))

    def example_inputs(self, batch_size, device, seq_len=None):
        n = seq_len or 8
        return {
            "ids": torch.randint(0, 100, (batch_size, n), device=device),
            "_target": torch.randint(0, 100, (batch_size, n), device=device),
        }

    def loss(self, outputs, inputs):
        return nn.functional.cross_entropy(outputs.flatten(0, 1), inputs["_target"].flatten())


def make(width=8):
    return Net(Cfg(width).width)


def make_tok():
    return Tok()


def broken():
    raise ValueError("bad width")


def not_a_module():
    return 3
"""


@pytest.fixture(scope="module")
def user_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("user") / "my_model.py"
    path.write_text(textwrap.dedent(USER_FILE))
    return path


# ---- every scheme builds on meta and steps on fake tensors ------------------------------


def test_torchvision_resnet18() -> None:
    built = build_model("torchvision:resnet18")
    assert built.source == "torchvision" and built.family == "cnn"
    assert all_on_meta(built) and built.default_image_size == 224
    batch = built.make_inputs(StepSpec(batch_size=4, image_size=64), CPU)
    assert batch["x"].shape == (4, 3, 64, 64) and batch["x"].dtype == torch.float32
    assert batch["_labels"].shape == (4,) and batch["_labels"].dtype == torch.int64
    assert set(built.forward_kwargs(batch)) == {"x"}  # labels are loss-only
    fake_step(built, StepSpec(batch_size=2, image_size=64), checkpointing=True)


def test_timm_model() -> None:
    built = build_model("timm:resnet18")
    assert built.source == "timm" and all_on_meta(built)
    assert built.default_image_size == 224
    fake_step(built, StepSpec(batch_size=2, image_size=64), checkpointing=True)


def test_file_factory(user_file: Path) -> None:
    built = build_model(ModelSpec(f"file:{user_file}:make", {"width": 4}))
    assert built.source == "file" and built.family == "cnn" and all_on_meta(built)
    assert built.module.stem.out_channels == 4  # options reach the factory
    with pytest.raises(InvalidInputError, match="image_size"):
        built.make_inputs(StepSpec(batch_size=2), CPU)
    batch = fake_step(built, StepSpec(batch_size=2, image_size=16), checkpointing=True)
    assert set(batch) == {"img"}  # named after forward's first argument


def test_file_example_inputs_and_loss(user_file: Path) -> None:
    built = build_model(f"file:{user_file}:make_tok")
    batch = built.make_inputs(StepSpec(batch_size=2, seq_len=5), CPU)
    assert batch["ids"].shape == (2, 5) and set(built.forward_kwargs(batch)) == {"ids"}
    fake_step(built, StepSpec(batch_size=2, seq_len=5))
    with pytest.raises(InvalidInputError, match="checkpoint"):
        built.enable_checkpointing(built.module)  # no blocks


TUPLE_FILE = """
import torch
from torch import nn


class Pair(nn.Module):
    def __init__(self, returns):
        super().__init__()
        self.emb, self.returns = nn.Embedding(50, 8), returns

    def forward(self, ids, mask):
        return self.emb(ids) * mask.unsqueeze(-1)

    def example_inputs(self, batch_size, device):
        ids = torch.zeros(batch_size, 4, dtype=torch.long, device=device)
        mask = torch.ones(batch_size, 4, device=device)
        return {"tuple": (ids, mask), "three": (ids, mask, mask), "list": [ids, mask]}[self.returns]


def make(returns="tuple"):
    return Pair(returns)
"""


def test_file_example_inputs_as_a_tuple(tmp_path: Path) -> None:
    path = tmp_path / "pair.py"
    path.write_text(TUPLE_FILE)
    built = build_model(f"file:{path}:make")
    batch = built.make_inputs(StepSpec(batch_size=2), CPU)
    assert list(batch) == ["ids", "mask"] and batch["mask"].shape == (2, 4)  # forward's order
    fake_step(built, StepSpec(batch_size=2))
    three = build_model(ModelSpec(f"file:{path}:make", {"returns": "three"}))
    with pytest.raises(InvalidInputError, match=r"takes 2 named argument.*not the 3 input\(s\)"):
        three.make_inputs(StepSpec(batch_size=2), CPU)
    # a list is one input (a detection model's list of images), not spread over arguments
    other = build_model(ModelSpec(f"file:{path}:make", {"returns": "list"}))
    with pytest.raises(InvalidInputError, match=r"returned list; return a dict \{forward_arg"):
        other.make_inputs(StepSpec(batch_size=2), CPU)


FUNCTIONS_FILE = """
import torch
from torch import nn


def example_inputs(batch_size, device, seq_len=None):
    return {"input": torch.randn(batch_size, seq_len or 8, device=device), "_y": torch.zeros(
        batch_size, device=device)}


def loss(outputs, inputs):
    return (outputs.sum(-1) - inputs["_y"]).square().mean()


def make():
    return nn.Linear(8, 8)
"""


def test_file_example_inputs_and_loss_as_functions_of_the_file(tmp_path: Path) -> None:
    """README and --help say "the module may define example_inputs": a hunt read module as
    the file and was told to define what it had defined; both readings work now."""
    path = tmp_path / "functions.py"
    path.write_text(FUNCTIONS_FILE)
    built = build_model(f"file:{path}:make")
    batch = built.make_inputs(StepSpec(batch_size=3, seq_len=8), CPU)
    assert batch["input"].shape == (3, 8) and built.reads == frozenset({"seq_len"})
    outputs = built.module.to_empty(device=CPU)(batch["input"])
    assert built.compute_loss(outputs, batch).shape == ()
    fake_step(built, StepSpec(batch_size=3, seq_len=8))


def test_file_errors(user_file: Path) -> None:
    with pytest.raises(InvalidInputError, match=r"file:.*:broken raised ValueError: bad width"):
        build_model(f"file:{user_file}:broken")
    with pytest.raises(InvalidInputError, match="returned int"):
        build_model(f"file:{user_file}:not_a_module")
    with pytest.raises(UnknownModelError, match="defines no 'nope'.*make_tok"):
        build_model(f"file:{user_file}:nope")
    with pytest.raises(UnknownModelError, match="no such file"):
        build_model(f"file:{user_file.parent}/missing.py:make")
    with pytest.raises(UnknownModelError, match="names no factory"):
        build_model(f"file:{user_file}")


# ---- shipped HF configs ------------------------------------------------------------------


def test_bare_names() -> None:
    assert resolve_name("alexnet") == "torchvision:alexnet"  # not in timm
    assert resolve_name("gpt2") == "hf:gpt2"
    assert resolve_name("meta-llama/Llama-3.2-1B") == "hf:meta-llama/Llama-3.2-1B"
    assert build_model("gpt2").spec.text == "hf:gpt2"


def test_ambiguous_bare_name() -> None:
    with pytest.raises(
        InvalidInputError, match=r"'resnet50' is ambiguous: torchvision:resnet50, timm:resnet50"
    ):
        build_model("resnet50")


def test_unknown_names_suggest() -> None:
    with pytest.raises(UnknownModelError, match=r"did you mean: .*torchvision:resnet50"):
        build_model("resnt50")
    with pytest.raises(UnknownModelError, match="did you mean: hf:gpt2"):
        build_model("hf:gpt-2")
    with pytest.raises(UnknownModelError, match="timm:resnet18"):
        build_model("timm:resnet-18")
    with pytest.raises(UnknownModelError, match="scheme"):
        build_model("tv:resnet50")


def test_list_models() -> None:
    hf = list_models("hf")
    assert "hf:gpt2" in hf and all(n.startswith("hf:") for n in hf)
    assert "torchvision:resnet50" in list_models("torchvision")
    assert list_models("file") == []
    with pytest.raises(InvalidInputError):
        list_models("pip")


# ---- vision details ------------------------------------------------------------------------


def test_native_image_sizes() -> None:
    assert build_model("torchvision:inception_v3").default_image_size == 299
    assert build_model("torchvision:efficientnet_b3").default_image_size == 300
    assert build_model("timm:vit_base_patch16_384").default_image_size == 384


def test_inception_aux_loss_and_batch_one() -> None:
    built = build_model("torchvision:inception_v3")
    with pytest.raises(InvalidInputError, match="batch_size >= 2"):
        built.make_inputs(StepSpec(batch_size=1), CPU)
    fake_step(built, StepSpec(batch_size=2))  # aux head gets gradients too (all params)


def test_fixed_size_vit_explains_option() -> None:
    built = build_model("torchvision:vit_b_16")
    with pytest.raises(InvalidInputError, match=r"model_options=\{image_size:384\}"):
        built.make_inputs(StepSpec(batch_size=1, image_size=384), CPU)
    assert (
        build_model(ModelSpec("torchvision:vit_b_16", {"image_size": 384})).default_image_size
        == 384
    )


def test_a_fixed_size_timm_vit_says_how_to_build_it_for_another_size() -> None:
    """It had said "pick a variant built for 33", which no timm ViT is (a hunt)."""
    built = build_model("timm:vit_tiny_patch16_224")
    with pytest.raises(InvalidInputError) as err:
        built.make_inputs(StepSpec(batch_size=1, image_size=33), CPU)
    assert str(err.value) == (
        "timm:vit_tiny_patch16_224 is built for 224x224 images; for 33, build it with "
        "model_options={img_size:33}, or leave image_size out"
    )


def test_an_untied_config_built_tied_says_what_it_leaves_out() -> None:
    """flan-t5's config unties its output layer and transformers 5 ties it anyway: 222.9 M
    parameters traced where the checkpoint has 247.6 M, said in a note (a hunt); gpt2, tied by
    its config, has none. 32128 x 768 = 24.7 M."""
    flan = build_model("hf:google/flan-t5-base")
    assert flan.info["notes"] == [
        "the config unties the output layer (tie_word_embeddings: false), but transformers "
        "builds T5ForConditionalGeneration with it tied to the input embeddings, so the "
        "checkpoint's own output layer (24.7 M parameters, with its gradient and optimizer "
        "state) is not counted"
    ]
    assert build_model("hf:gpt2").info["notes"] == []


def test_detection_and_optical_flow_rejected() -> None:
    for name in ("fasterrcnn_resnet50_fpn", "raft_small"):
        with pytest.raises(InvalidInputError, match="detection and optical flow are not"):
            build_model(f"torchvision:{name}")


def test_regnet_builds_on_meta_despite_value_reads() -> None:
    assert all_on_meta(build_model("torchvision:regnet_y_400mf"))


def test_checkpoint_blocks_rule() -> None:
    m = build_model("torchvision:resnet18").module
    paths = {id(mod): name for name, mod in m.named_modules()}
    assert [paths[id(b)] for b in find_blocks(m)] == [
        f"layer{i}.{j}" for i in range(1, 5) for j in range(2)
    ]
    vit = build_model("torchvision:vit_b_16").module
    assert len(find_blocks(vit)) == 12


def test_lists_of_plain_layers_are_no_blocks_to_checkpoint() -> None:
    """Two ModuleLists of leaf layers under the root (stacked LSTMs and their norms): a
    ModuleList is never called, so replacing its forward would checkpoint nothing; the
    rule finds no blocks (checkpointing then stops with its one-line error)."""

    nn = torch.nn

    class Stacked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnns = nn.ModuleList([nn.LSTM(8, 8) for _ in range(3)])
            self.norms = nn.ModuleList([nn.LayerNorm(8) for _ in range(3)])

    assert find_blocks(Stacked()) == []


def test_vgg_checkpointing_recomputes_segments() -> None:
    """VGG's features are plain layers: checkpointed as segments ending at each pool."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountConvs(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func is torch.ops.aten.convolution.default:
                CountConvs.n += 1
            return func(*args, **(kwargs or {}))

    built = build_model(ModelSpec("torchvision:vgg11", {"num_classes": 10}))
    with FakeTensorMode(allow_non_fake_inputs=True):
        built.materialize("cpu")
        built.enable_checkpointing(built.module)
        batch = built.make_inputs(StepSpec(batch_size=1, image_size=32), CPU)
        with CountConvs():  # entered inside the fake mode, so it sees every aten call
            built.compute_loss(built.module(**built.forward_kwargs(batch)), batch).backward()
    assert CountConvs.n == 2 * 8  # every conv of vgg11 runs again in backward


def test_a_quantized_classifier_is_refused_naming_its_float_model() -> None:
    with pytest.raises(InvalidInputError, match="torchvision:resnet18 is the float model"):
        build_model("torchvision:quantized_resnet18")


@pytest.mark.parametrize(
    ("model", "options"),
    [
        ("torchvision:deeplabv3_resnet50", {"weights_backbone": "DEFAULT"}),
        ("torchvision:resnet18", {"weights": "DEFAULT"}),
        ("timm:resnet18", {"pretrained": True}),
    ],
)
def test_options_asking_for_pretrained_weights_are_one_line(model, options) -> None:
    """Models are built without weights: an option that asks for them is refused before any
    download starts (deeplabv3's weights_backbone=DEFAULT downloaded, or tracebacked offline)."""
    ((key, value),) = options.items()
    with pytest.raises(InvalidInputError) as err:
        build_model(ModelSpec(model, options))
    assert str(err.value) == (
        f"{model}: model_options.{key}={value!r} asks for pretrained weights; models are built"
        " without them (values change neither memory nor time): drop it"
    )
