"""The analytic collectives (``parallel/time.py``, ``collectives.py``) against the real wrappers.

DDP, FSDP2 ``fully_shard`` and DTensor tensor parallelism run one step of rank 0 on PyTorch's
fake process group (``parallel/traced.py``); the collectives they issue must be the analytic
model's, to the byte. The model is the synthetic tiny Llama of ``tiny_models.py`` (2 layers,
hidden 64, MLP 128, 4 query / 2 KV heads of 16, vocabulary 256, untied): every dimension is
divisible by the group sizes, so FSDP2 pads no shard.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
from tiny_models import tiny_llama_config

from boom_ml.parallel.collectives import DDP_BUCKET_BYTES, GroupLink, ddp_buckets
from boom_ml.parallel.layout import Layout
from boom_ml.parallel.profile import TimeProfile
from boom_ml.parallel.shard import param_split, rank_config
from boom_ml.parallel.time import Shape, step_time, tp_collectives
from boom_ml.parallel.traced import summarize, trace_collectives

transformers = pytest.importorskip("transformers")

RAW = tiny_llama_config(vocab_size=256, tie_word_embeddings=False)
LAYERS, H, BATCH, SEQ = 2, 64, 2, 16


def build(checkpointing: bool = False, raw: dict | None = None):
    def make():
        config = transformers.LlamaConfig(**(raw or RAW))
        model = transformers.LlamaForCausalLM(config)
        if checkpointing:  # as the zoo enables it (boom_ml/zoo/hf_models.py)
            model.gradient_checkpointing_enable({"use_reentrant": False})
        return model.train()

    return make


def loss_fn(amp: bool = False):
    def run(model):
        ids = torch.randint(0, RAW["vocab_size"], (BATCH, SEQ))
        with torch.autocast("cpu", torch.bfloat16, enabled=amp):
            return model(input_ids=ids, labels=ids).loss

    return run


def with_recipe(make, **step_fields):
    """``make`` with a training recipe applied as the tracer applies it (dtype, LoRA)."""
    from boom_ml.specs import StepSpec
    from boom_ml.zoo.finetune import apply_recipe

    def made():
        model = make()
        apply_recipe(model, StepSpec(batch_size=BATCH, seq_len=SEQ, **step_fields))
        return model

    return made


def shape(raw: dict = RAW, tp: int = 1, checkpointing: bool = False, amp: bool = False,
          **recipe) -> Shape:  # fmt: skip
    """The analytic model's inputs, its parameter counts from ``shard.py`` on the built model
    (with ``recipe``'s StepSpec fields applied)."""
    split = param_split(with_recipe(build(raw=rank_config(raw, tp, LAYERS)), **recipe)())
    return Shape(batch_size=BATCH, seq_len=SEQ, hidden=H, act_bytes=2 if amp else 4,
                 checkpointing=checkpointing, params_layer=split["layers"] // LAYERS,
                 params_first=split["first"], params_last=split["last"],
                 trainable_layer=split["trainable_layers"] // LAYERS,
                 trainable_first=split["trainable_first"], trainable_last=split["trainable_last"],
                 grad_bytes=split["trainable_bytes"], param_bytes=split["bytes"])  # fmt: skip


def groups(dp: int = 1, tp: int = 1) -> dict[str, GroupLink]:
    return {name: GroupLink(name, n, "nvlink4", 370.0, 3.4, 8.4)
            for name, n in (("tp", tp), ("dp", dp), ("pp", 1))}  # fmt: skip


def analytic(sh: Shape, layout: Layout) -> dict[tuple[str, str], dict[str, int]]:
    """(group, op) -> calls and bytes per step of ``time.step_time``'s collectives."""
    prof = TimeProfile(layer_ms=1.0, first_ms=0.0, last_ms=0.0, opt_layer_ms=0.0,
                       opt_ends_ms=0.0, backward_fraction=0.5, method="synthetic")  # fmt: skip
    out: dict[tuple[str, str], dict[str, int]] = {}
    for c in step_time(prof, sh, layout, [LAYERS], groups(layout.dp, layout.tp))["collectives"]:
        row = out.setdefault((c["group"], c["op"]), {"calls": 0, "bytes": 0})
        row["calls"] += c["calls"]
        row["bytes"] += c["bytes"] * c["calls"]
    return out


def traced_totals(calls, phases=("forward", "backward")) -> dict[tuple[str, str], dict[str, int]]:
    out: dict[tuple[str, str], dict[str, int]] = {}
    for (group, op, phase), row in summarize(calls).items():
        if phase in phases:
            acc = out.setdefault((group, op), {"calls": 0, "bytes": 0})
            acc["calls"] += row["calls"]
            acc["bytes"] += row["bytes"]
    return out


# --- DDP ----------------------------------------------------------------------------------


def test_ddp_all_reduces_every_gradient_byte_once():
    env = dict(os.environ)
    layout = Layout(dp=4, microbatches=2)  # the first micro-batch under no_sync
    calls = trace_collectives(build(), loss_fn(), layout)
    assert not torch.distributed.is_initialized() and dict(os.environ) == env  # no leaks
    reduces = [c for c in calls if c.op == "all_reduce"]
    assert {(c.group, c.group_size, c.phase, c.dtype) for c in reduces} == {
        ("dp", 4, "backward", "torch.float32")
    }
    want = analytic(shape(), layout)[("dp", "all_reduce")]
    assert (
        sum(c.bytes for c in reduces)
        == want["bytes"]
        == 4 * sum(p.numel() for p in build()().parameters())
    )
    # the tiny model fits DDP's first (1 MiB) bucket; buffers are broadcast every forward
    assert len(reduces) == len(ddp_buckets([want["bytes"]])) == want["calls"] == 1
    assert {c.op for c in calls} == {"all_reduce", "broadcast"}
    assert not [c for c in calls if c.phase == "optimizer"]


class Wide(torch.nn.Module):
    """72 MiB of fp32 parameters: a 32 MiB embedding and ten 4 MiB linears."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(8192, 1024)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(1024, 1024) for _ in range(10))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x.square().mean()


def test_ddp_buckets_follow_the_size_rule_and_the_last_holds_the_embedding():
    calls = trace_collectives(Wide, lambda m: m(torch.randint(0, 8192, (2, 4))), Layout(dp=2))
    traced = [c.bytes for c in calls if c.op == "all_reduce"]
    ready = [4 * p.numel() for p in reversed(list(Wide().parameters()))]  # backward order
    assert traced == ddp_buckets(ready)
    # a linear is 4 MiB + 4 KiB (4,198,400 B): the first closes the 1 MiB bucket; the next
    # seven reach the 25 MiB cap (six are 25,190,400 B, under it); the last two linears and
    # the 32 MiB embedding make the last bucket, exposed after the backward
    layer, emb = 4 * (1024 * 1024 + 1024), 4 * 8192 * 1024
    assert traced == [layer, 7 * layer, 2 * layer + emb] == [4_198_400, 29_388_800, 41_951_232]
    assert 6 * layer < DDP_BUCKET_BYTES <= 7 * layer


# --- FSDP2 --------------------------------------------------------------------------------


@pytest.mark.parametrize("checkpointing", [False, True])
def test_fsdp2_gathers_and_reduce_scatters_equal_the_analytic_ones(checkpointing):
    layout = Layout(dp=4, sharding="fsdp", microbatches=2)
    calls = trace_collectives(build(checkpointing), loss_fn(), layout)
    sh = shape(checkpointing=checkpointing)
    assert traced_totals(calls) == {k: v for k, v in analytic(sh, layout).items() if k[0] == "dp"}
    # the root (embedding, final norm, head) is gathered in forward only (not resharded)
    root = 4 * (sh.params_first + sh.params_last)
    assert [c.phase for c in calls if c.op == "all_gather" and c.bytes == root] == ["forward"] * 2
    assert {(c.group_size, c.dtype) for c in calls} == {(4, "torch.float32")}


# --- recipes: LoRA freezes all but its adapters, params_dtype sets every byte count ---------


@pytest.mark.parametrize(
    ("layout", "recipe"),
    [
        (Layout(dp=4, microbatches=2), {"finetune_method": "lora"}),
        (Layout(dp=4, sharding="fsdp", microbatches=2), {"finetune_method": "lora"}),
        (Layout(dp=4, sharding="fsdp"), {"params_dtype": "bf16"}),
        # bf16 weights, fp32 adapters (peft's default): the gathers carry the bf16 majority
        (Layout(dp=4, sharding="fsdp"), {"params_dtype": "bf16", "finetune_method": "lora"}),
    ],
)
def test_recipes_collectives_equal_the_analytic_ones(layout, recipe):
    # peft cannot move its adapters onto fake tensors: real (tiny) ones here
    calls = trace_collectives(with_recipe(build(), **recipe), loss_fn(), layout, fake=False)
    sh = shape(**recipe)
    traced = {k: v for k, v in traced_totals(calls).items() if k[1] != "broadcast"}  # buffers
    assert traced == {k: v for k, v in analytic(sh, layout).items() if k[0] == "dp"}
    dtype = "torch.bfloat16" if recipe.get("params_dtype") == "bf16" else "torch.float32"
    if len(recipe) == 1:
        assert {c.dtype for c in calls if c.op != "broadcast"} == {dtype}
    else:  # bf16 weights with fp32 adapters in a layer: FSDP2 gathers that unit as bytes
        gathers = {c.dtype for c in calls if c.op == "all_gather"}
        assert gathers == {"torch.uint8", "torch.bfloat16"}  # the root has no adapter
    if recipe.get("finetune_method") == "lora":  # only the adapters' gradients are reduced
        reduced = sum(c.bytes for c in calls if c.op in ("all_reduce", "reduce_scatter"))
        times = layout.microbatches if layout.zero_stage == 3 else 1  # DDP: under no_sync
        assert reduced == times * 4 * LAYERS * sh.trainable_layer


# --- tensor parallel ----------------------------------------------------------------------


@pytest.mark.parametrize("checkpointing", [False, True])
def test_tp_all_reduces_equal_the_analytic_ones(checkpointing):
    """Layers, vocabulary-parallel embedding and head, and loss_parallel's cross-entropy, under
    bf16 autocast: layer outputs in bf16, everything in the fp32 residual stream in fp32."""
    calls = trace_collectives(build(checkpointing), loss_fn(amp=True), Layout(tp=2))
    sh = shape(tp=2, checkpointing=checkpointing, amp=True)
    want: Counter[int] = Counter()
    for c in tp_collectives(sh, LAYERS, True, True, groups(tp=2)["tp"]):
        want[c.bytes] += c.calls
    assert Counter(c.bytes for c in calls) == want
    assert {(c.op, c.group, c.group_size) for c in calls} == {("all_reduce", "tp", 2)}
    tokens = BATCH * SEQ
    fwd = [(c.bytes, c.dtype[6:]) for c in calls if c.phase == "forward"]
    assert (
        fwd
        == [(tokens * H * 4, "float32")]
        + [(tokens * H * 2, "bfloat16")] * 2 * LAYERS
        + [
            (tokens * 4, "float32")  # cross-entropy: max, sum of exponentials, target logit
        ]
        * 3
    )


def test_fsdp2_over_tensor_parallel_equals_the_analytic_tp_rank():
    """dp 2 x tp 2: FSDP2 shards the tp rank's parameters (``shard.rank_config``'s model)."""
    layout = Layout(dp=2, tp=2, sharding="fsdp")
    calls = trace_collectives(build(), loss_fn(), layout)
    assert traced_totals(calls) == analytic(shape(tp=2), layout)


def test_untraced_layouts_say_so():
    with pytest.raises(NotImplementedError, match="analytically"):
        trace_collectives(build(), loss_fn(), Layout(dp=2, sharding="zero1"))
    with pytest.raises(ValueError, match="real tensors"):
        trace_collectives(build(), loss_fn(), Layout(dp=2), fake=True)


# --- FSDP2 under torch.distributed.pipelining -------------------------------------------


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("sharding", ["zero2", "fsdp"])
def test_fsdp2_under_torch_pipelining_equals_the_analytic_stage(sharding, schedule):
    """One pipeline stage holding the whole model, wrapped as data_collection/pipeline_steps.py
    wraps a stage (fully_shard per layer and the stage root; zero2 not resharded after
    forward), run by torch's own schedule over 4 micro-batches on the fake group: its
    gathers and reduce-scatters are the analytic ones of a pipeline stage (fsdp.py)."""
    import torch.distributed.pipelining as pipelining
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from boom_ml.parallel.fsdp import fsdp_collectives
    from boom_ml.parallel.traced import _recorder, fake_process_group

    m, dp = 4, 4
    runs = {"1f1b": pipelining.Schedule1F1B, "gpipe": pipelining.ScheduleGPipe}[schedule]

    class Logits(torch.nn.Module):  # a stage's module returns a tensor for the schedule
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, ids):
            return self.model(input_ids=ids).logits

    def loss(logits, target):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())

    with fake_process_group(dp):
        mesh = init_device_mesh("cpu", (1, dp), mesh_dim_names=("pp", "dp"))
        stage_module = Logits(build()())
        reshard = sharding != "zero2"
        for block in stage_module.model.model.layers:
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=reshard)
        fully_shard(stage_module, mesh=mesh["dp"], reshard_after_forward=reshard)
        stage = pipelining.PipelineStage(stage_module, 0, 1, torch.device("cpu"),
                                         group=mesh["pp"].get_group())  # fmt: skip
        run = runs(stage, n_microbatches=m, loss_fn=loss)
        rec = _recorder({mesh.get_group("dp").group_name: "dp"})
        ids = torch.randint(0, RAW["vocab_size"], (m * BATCH, SEQ))
        with rec:
            for step in range(2):  # the second step is recorded
                rec.phase = "step" if step else None
                run.step(ids, target=ids)
    traced = {(c.op, c.bytes): 0 for c in rec.calls}
    for c in rec.calls:
        traced[(c.op, c.bytes)] += 1
    sh = shape()
    params = LAYERS * sh.params_layer + sh.params_first + sh.params_last
    analytic_calls = fsdp_collectives(
        Layout(dp=dp, pp=2, sharding=sharding, microbatches=m), groups(dp)["dp"],
        params=params, layer_params=LAYERS * sh.params_layer, trainable=params,
        layer_trainable=LAYERS * sh.params_layer, unit_params=sh.params_layer,
        param_bytes=4, grad_bytes=4, backward_ms=1.0, compute_mb_ms=2.0,
    )  # fmt: skip
    expect: dict[tuple[str, int], int] = {}
    for c in analytic_calls:  # a layer's calls are per unit: LAYERS units of the same bytes
        key = (c.op, c.bytes)
        expect[key] = expect.get(key, 0) + c.calls
    assert traced == expect
    gathers = 1 if sharding == "zero2" else m + 1  # a unit's, the root's too
    assert expect[("all_gather", 4 * sh.params_layer)] == LAYERS * gathers
