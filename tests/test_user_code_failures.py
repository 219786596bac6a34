"""What a user's own model file meets, and what it is told: a project split into files, a
dataclass of outputs, CUDA in the model, value-dependent shapes, sparse gradients (a hunt ran
each; the models here are small and made up for the test)."""

from __future__ import annotations

import json
import textwrap

import pytest

from boom_ml.errors import BoomError
from boom_ml.predict import run
from tests.test_predict_cli import BASE

MODELS = textwrap.dedent(
    """
    import dataclasses
    import torch
    import torch.nn.functional as F
    from torch import nn
    from layers import block  # a sibling file, as `python model.py` would import it


    class Net(nn.Module):
        def __init__(self, mode):
            super().__init__()
            self.mode, self.fc1, self.fc2 = mode, block(64), nn.Linear(64, 10)

        def forward(self, x):
            h = self.fc1(x)
            if self.mode == "cuda_tensor":
                h = h + torch.zeros(h.shape[-1], device="cuda")
            return self.fc2(h)

        def example_inputs(self, batch_size, device):
            return torch.randn(batch_size, 64, device=device)


    def make(mode="plain"):
        net = Net(mode)
        return net.cuda() if mode == "cuda_model" else net


    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor
        hidden: torch.Tensor


    class Dataclass(Net):
        def forward(self, x):
            h = self.fc1(x)
            return Out(self.fc2(h), h)


    def dataclass_out():
        return Dataclass("plain")


    class Masked(nn.Module):
        def __init__(self, sparse=False):
            super().__init__()
            self.emb, self.out = nn.Embedding(100, 32, sparse=sparse), nn.Linear(32, 100)

        def forward(self, ids):
            return self.out(self.emb(ids))

        def example_inputs(self, batch_size, device):
            ids = torch.randint(0, 100, (batch_size, 16), device=device)
            return {"ids": ids, "_labels": ids}

        def loss(self, out, batch):
            keep = batch["_labels"] > 50
            return F.cross_entropy(out[keep], batch["_labels"][keep])


    def masked():
        return Masked()


    class Sparse(Masked):
        def loss(self, out, batch):
            return out.float().mean()


    def sparse():
        return Sparse(sparse=True)


    class Wrong(Net):
        def __init__(self):
            super().__init__("plain")
            self.fc2 = nn.Linear(60, 10)  # fc1 gives 64 features


    def wrong():
        return Wrong()
    """
)
CUDA = (
    "(the model or its inputs ask for CUDA (.cuda(), .to('cuda'), device='cuda'); boom-ml "
    "traces on this machine, without a GPU, and gpu= names the GPU: build the model on the "
    "default device and make its inputs on example_inputs' device argument)"
)


@pytest.fixture
def model_file(tmp_path):
    (tmp_path / "layers.py").write_text(
        "from torch import nn\n\n\ndef block(d):\n    return nn.Sequential(nn.Linear(d, d), nn.ReLU())\n"
    )
    (tmp_path / "model.py").write_text(MODELS)
    return tmp_path / "model.py"


def _options(model_file, factory: str, **kw) -> dict:
    return {**BASE, "model": f"file:{model_file}:{factory}", "batch_size": 4, "advice": False,
            "max_batch": "off", **kw}  # fmt: skip


def test_a_file_imports_its_siblings_and_a_dataclass_output_is_trained(model_file):
    """`from layers import block` works from any working directory; a dataclass's two float
    fields get the default loss (it had been 'returned no floating-point tensor')."""
    plain = json.loads(run(_options(model_file, "make")))
    dataclass = json.loads(run(_options(model_file, "dataclass_out")))
    # Linear(64, 64) and Linear(64, 10): 4,160 + 650 parameters, in both
    assert plain["graph"]["num_parameters"] == dataclass["graph"]["num_parameters"] == 4810


@pytest.mark.parametrize(
    ("factory", "options", "ends"),
    [
        ("make", {"model_options": {"mode": "cuda_model"}}, "Found no NVIDIA driver"),
        ("make", {"model_options": {"mode": "cuda_tensor"}}, "cpu and cuda:0!"),
        ("masked", {}, "DynamicOutputShapeException: aten.nonzero.default"),
        ("sparse", {"optimizer": "sgd"}, "Cannot access storage of SparseTensorImpl"),
    ],
)
def test_failures_of_user_code_say_what_helps(model_file, factory, options, ends):
    hint = {
        "masked": "(an op whose output size depends on values (boolean-mask indexing, nonzero, "
        "pack_padded_sequence); fake tensors have shapes, not values: mask with masked_fill "
        "and an ignore_index, keep sequences padded)",
        "sparse": "(sparse gradients (nn.Embedding(sparse=True)) are not modelled: trace with "
        "sparse=False, whose dense gradient is what AdamW and most optimizers need anyway)",
    }.get(factory, CUDA)
    with pytest.raises(BoomError) as err:
        run(_options(model_file, factory, **options))
    said = str(err.value)
    assert "\n" not in said and said.endswith(" " + hint)
    assert ends in said


def test_a_shape_mismatch_names_the_module_it_met(model_file):
    """A hunt: in a large model the op and PyTorch's words alone did not say where."""
    with pytest.raises(BoomError) as err:
        run(_options(model_file, "wrong"))
    assert str(err.value) == (
        f"could not trace file:{model_file}:wrong in module fc2 (Linear): RuntimeError: a and b"
        " must have same reduction dim, but got [4, 64] X [60, 10]."
    )


def test_a_model_built_in_bf16_says_params_dtype_names_it(tmp_path):
    """A hunt: a factory returning model.to(torch.bfloat16) was labelled fp32 without a word,
    and its time model followed the label."""
    path = tmp_path / "half.py"
    path.write_text(
        "import torch\nfrom torch import nn\n\n\ndef make():\n"
        "    return nn.Sequential(nn.Linear(64, 64), nn.ReLU()).to(torch.bfloat16)\n\n\n"
        "def example_inputs(batch_size, device):\n"
        "    return torch.randn(batch_size, 64, device=device, dtype=torch.bfloat16)\n"
    )
    note = (
        "the factory's parameters are bf16 and are traced as built; params_dtype=bf16 names the"
        " step so (its time model and the header follow the name, params_dtype=fp32)"
    )
    plain = json.loads(run({**BASE, "model": f"file:{path}:make", "advice": False,
                            "max_batch": "off"}))  # fmt: skip
    assert note in plain["graph"]["model_notes"]
    named = json.loads(run({**BASE, "model": f"file:{path}:make", "advice": False,
                            "max_batch": "off", "params_dtype": "bf16"}))  # fmt: skip
    assert named["graph"]["model_notes"] == []


def test_an_image_too_small_for_a_head_says_what_helps():
    """inception_v3 at 75 px (its main path's smallest) fails in its auxiliary head: the
    module is named and both ways out said (a hunt had seen PyTorch's words alone)."""
    options = {**BASE, "model": "torchvision:inception_v3", "image_size": 75, "advice": False,
               "max_batch": "off"}  # fmt: skip
    with pytest.raises(BoomError) as err:
        run(options)
    assert str(err.value) == (
        "could not trace torchvision:inception_v3 in module AuxLogits (InceptionAux): "
        "RuntimeError: Given input size: (768x3x3). Calculated output size: (768x0x0). Output "
        "size is too small (the input shrinks below a layer's kernel on its way through the "
        "model: give larger inputs (image_size, for an image model), or leave out the auxiliary "
        "head: model_options.aux_logits=false)"
    )


@pytest.mark.parametrize(
    ("model", "size", "hint"),
    [
        ("torchvision:maxvit_t", 448, "model_options={input_size:[448,448]}"),
        ("timm:mixer_b16_224", 256, "model_options={img_size:256}"),
    ],
)
def test_a_fixed_size_model_at_another_size_names_the_keyword_that_builds_it(model, size, hint):
    """A hunt: maxvit_t at 448 and timm's MLP-Mixer at 256 had stopped on a reshape's or an
    assertion's words alone; their constructors take the size by these keywords."""
    options = {**BASE, "model": model, "image_size": size, "advice": False, "max_batch": "off"}
    with pytest.raises(BoomError) as err:
        run(options)
    assert str(err.value).endswith(
        f" (it is built for 224x224 images; build it for {size} with {hint}, where its"
        " architecture allows that size)"
    )


def test_torchvision_sizes_and_classes_say_what_they_take():
    """A ViT side its patches do not tile had been told to build for it, which torchvision
    refuses; num_classes=0 had failed drawing labels (a hunt)."""
    with pytest.raises(BoomError) as err:
        run({**BASE, "model": "torchvision:vit_b_16", "image_size": 225, "advice": False,
             "max_batch": "off"})  # fmt: skip
    assert str(err.value) == (
        "torchvision:vit_b_16 takes image sides that are a multiple of its patch size 16 (224 "
        "or 240), not 225; it is built for 224x224 and takes another such side built with "
        "model_options={image_size:240}"
    )
    with pytest.raises(BoomError, match=r"num_classes=0: a torchvision classifier needs"):
        run({**BASE, "model_options": {"num_classes": 0}, "advice": False, "max_batch": "off"})


def test_sibling_modules_of_two_model_folders_stay_apart(tmp_path):
    """Each folder's layers.py is its own (the review of the sys.path change: the first
    folder's module had been reused by name for the second)."""
    from boom_ml.zoo import build_model

    counts = []
    for width in (8, 16):
        folder = tmp_path / f"w{width}"
        folder.mkdir()
        (folder / "layers.py").write_text(f"from torch import nn\n\nWIDTH = {width}\n")
        (folder / "model.py").write_text(
            "from torch import nn\nfrom layers import WIDTH\n\n\n"
            "def make():\n    return nn.Linear(WIDTH, WIDTH)\n"
        )
        built = build_model(f"file:{folder / 'model.py'}:make")
        counts.append(sum(p.numel() for p in built.module.parameters()))
    assert counts == [8 * 8 + 8, 16 * 16 + 16]
