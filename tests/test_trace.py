"""The tracer: FLOPs, AMP dtypes, checkpointing, optimizer phases, memory events, I/O."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import torch
from tiny_models import tiny_cnn, tiny_llama_config, tiny_transformer
from torch import nn

from boom_ml.specs import ModelSpec, StepSpec
from boom_ml.trace.graph import OpGraph
from boom_ml.trace.step import reference_flops, trace_step
from boom_ml.zoo import build_model
from boom_ml.zoo.base import BuiltModel


def forward_dtypes(graph: OpGraph, op: str) -> set[str]:
    rows = graph.nodes[(graph.nodes["op"] == op) & (graph.nodes["phase"] == "forward")]
    assert len(rows), f"no forward {op} in the graph"
    return {json.loads(d)[0] for d in rows["output_dtypes"]}


@pytest.mark.parametrize("factory", [tiny_cnn, tiny_transformer])
@pytest.mark.parametrize("amp", ["none", "bf16"])
def test_flops_equal_flop_counter_mode(factory, amp):
    step = StepSpec(batch_size=2, amp=amp, optimizer="adamw")
    graph = trace_step(factory(), step)
    assert graph.flops > 0
    assert graph.flops == reference_flops(factory(), step)


def test_a_step_beyond_int64_flops_counts_exactly():
    """Node counts are int64; their sum is not bounded by it (resnet18 at batch 1e9 came
    out at -7.8e18 FLOP)."""
    graph = trace_step(tiny_cnn(), StepSpec(batch_size=2, optimizer="none"))
    graph.nodes["flops"] = 2**62  # each within int64, their sum far beyond it
    assert graph.flops == len(graph.nodes) * 2**62


def test_matmul_flops_exact():
    # Linear(32→96) on 2×16 tokens: 2·M·N·K = 2·32·32·96 forward.
    graph = trace_step(tiny_transformer(), StepSpec(batch_size=2, seq_len=16, optimizer="none"))
    qkv = graph.nodes[
        graph.nodes["module"].str.endswith("qkv.0") & (graph.nodes["phase"] == "forward")
    ]
    assert qkv["flops"].sum() == 2 * 32 * 32 * 96


@pytest.mark.parametrize("groups", [1, 2, 8])
def test_conv_backward_flops_exact(groups):
    # A convolution's input and weight gradients are each as many FLOPs as its forward:
    # 2·N·OH·OW·KH·KW·O·C/groups; torch's formula counts the weight gradient as if groups
    # were 1 (groups times too many: 8 times for this depthwise one).
    graph = trace_step(tiny_cnn(groups), StepSpec(batch_size=2, optimizer="none"))
    nodes = graph.nodes[graph.nodes["family"] == "conv"]
    by = nodes.groupby(["module", "phase"])["flops"].sum()
    second = 2 * 2 * 16 * 16 * 3 * 3 * 8 * (8 // groups)
    assert by[("TinyCnn.blocks.1.0", "forward")] == second
    assert by[("TinyCnn.blocks.1.0", "backward")] == 2 * second
    first = 2 * 2 * 16 * 16 * 3 * 3 * 8 * 3
    assert (
        by[("TinyCnn.blocks.0.0", "backward")] == first
    )  # the image needs no gradient: weight only


@pytest.mark.parametrize("amp,low", [("fp16", "float16"), ("bf16", "bfloat16")])
def test_amp_dtypes(amp, low):
    graph = trace_step(tiny_transformer(), StepSpec(batch_size=2, amp=amp))
    assert forward_dtypes(graph, "addmm") == {low}
    assert forward_dtypes(graph, "_scaled_dot_product_flash_attention") == {low}
    assert forward_dtypes(graph, "native_layer_norm") == {"float32"}
    assert forward_dtypes(graph, "_softmax") == {"float32"}
    cnn = trace_step(tiny_cnn(), StepSpec(batch_size=2, amp=amp))
    assert forward_dtypes(cnn, "cudnn_convolution") == {low}
    assert (cnn.mem_events["category"] == "autocast_copy").any()


def test_fp32_attention_uses_memory_efficient_kernel():
    graph = trace_step(tiny_transformer(), StepSpec(batch_size=2))
    ops = set(graph.nodes["op"])
    assert "_scaled_dot_product_efficient_attention" in ops
    assert "_scaled_dot_product_efficient_attention_backward" in ops


def saved_activation_bytes(graph: OpGraph) -> int:
    ev = graph.mem_events
    alive = ev[
        (ev["category"] == "activation") & (ev["action"] == "alloc") & (ev["phase"] == "forward")
    ]
    return int(alive["bytes"].sum())


@pytest.mark.parametrize("factory", [tiny_cnn, tiny_transformer])
def test_checkpointing_recomputes_and_saves_less(factory):
    plain = trace_step(factory(), StepSpec(batch_size=4))
    ckpt = trace_step(factory(), StepSpec(batch_size=4, checkpointing="full"))
    assert (plain.nodes["phase"] == "recompute").sum() == 0
    assert (ckpt.nodes["phase"] == "recompute").sum() > 0
    assert saved_activation_bytes(ckpt) < saved_activation_bytes(plain)


@pytest.mark.parametrize("recipe", [{}, {"finetune_method": "qlora"}], ids=["full", "qlora"])
def test_a_recomputation_repeats_its_layers_forward_ops_and_modules(tmp_path, recipe):
    """Each layer's re-run is the start of its forward, op for op and module for module: the
    residual add between two re-entered modules belongs to the layer (not to the next layer's
    attention, still active in backward), and the 4-bit matmuls' dequantisation, run with grad
    mode off inside the re-run, is recomputation, not backward."""
    (tmp_path / "config.json").write_text(json.dumps(tiny_llama_config(num_hidden_layers=4)))
    model = build_model(ModelSpec(f"hf:{tmp_path / 'config.json'}"))
    step = StepSpec(batch_size=2, seq_len=32, amp="bf16", checkpointing="full", **recipe)
    nodes = trace_step(model, step).nodes
    for layer in range(4):
        mine = nodes[nodes.module.str.contains(rf"\.layers\.{layer}(?:\.|$)")]
        ops = {p: list(zip(rows.op, rows.module, strict=True)) for p, rows in mine.groupby("phase")}
        assert 0 < len(ops["recompute"]) < len(ops["forward"])
        assert ops["recompute"] == ops["forward"][: len(ops["recompute"])]
    dequantised = nodes[nodes.op == "dequantize_nf4"].phase.value_counts().to_dict()
    if recipe:  # 7 projections a layer, each dequantised in forward and in backward; the
        # re-run stops once it has the down projection's input, what backward saved of it
        assert dequantised == {"forward": 28, "recompute": 24, "backward": 28}
        rerun = nodes[(nodes.op == "dequantize_nf4") & (nodes.phase == "recompute")]
        assert not rerun.module.str.contains("down_proj").any()


LOOPED = """
import torch
from torch import nn


class Block(nn.Module):  # its layers in a ModuleList it loops over: the list is never called
    def __init__(self):
        super().__init__()
        self.mods = nn.ModuleList([nn.Linear(64, 64), nn.Linear(64, 64)])

    def forward(self, x):
        y = x * 2.0
        for m in self.mods:
            y = torch.tanh(m(y))
        return y + x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 64)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(64, 100)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)

    def example_inputs(self, batch_size, device, seq_len=16, **kw):
        return {"x": torch.randint(0, 100, (batch_size, seq_len), device=device)}
"""


def test_a_recomputed_op_between_looped_layers_belongs_to_their_block(tmp_path):
    """A block checkpointed by the zoo (its forward replaced, so not entered again in the
    re-run): the tanh between its two Linears is the block's, as in forward, not its
    ModuleList's, which never runs."""
    (tmp_path / "looped.py").write_text(LOOPED)
    step = StepSpec(batch_size=2, seq_len=16, checkpointing="full")
    nodes = trace_step(build_model(ModelSpec(f"file:{tmp_path / 'looped.py'}:Net")), step).nodes
    for block in range(3):
        mine = nodes[nodes.module.str.contains(rf"\.blocks\.{block}(?:\.|$)")]
        ops = {p: list(zip(rows.op, rows.module, strict=True)) for p, rows in mine.groupby("phase")}
        assert 0 < len(ops["recompute"]) < len(ops["forward"])
        assert ops["recompute"] == ops["forward"][: len(ops["recompute"])]
        assert ("tanh", f"Net.blocks.{block}") in ops["recompute"]


def test_optimizer_none_has_no_optimizer_nodes():
    graph = trace_step(tiny_cnn(), StepSpec(batch_size=2, optimizer="none"))
    assert not (graph.nodes["phase"] == "optimizer").any()
    assert not (graph.mem_events["category"] == "optimizer_state").any()
    adam = trace_step(tiny_cnn(), StepSpec(batch_size=2, optimizer="adam"))
    assert (adam.nodes["phase"] == "optimizer").any()


def test_memory_events_balance_and_state_sizes():
    graph = trace_step(tiny_cnn(), StepSpec(batch_size=2, optimizer="adamw"))
    ev = graph.mem_events
    params = ev[(ev["category"] == "parameter") & (ev["action"] == "alloc")]
    state = ev[(ev["category"] == "optimizer_state") & (ev["action"] == "alloc")]
    module = tiny_cnn().module
    param_bytes = sum(p.numel() * 4 for p in module.parameters())
    buffer_bytes = sum(b.numel() * b.element_size() for b in module.buffers())
    assert params["bytes"].sum() == param_bytes + buffer_bytes
    assert state["bytes"].sum() == 2 * param_bytes  # exp_avg + exp_avg_sq, fp32
    # every free matches an earlier alloc of the same block
    allocs = set(ev.loc[ev["action"] == "alloc", "block"])
    assert set(ev.loc[ev["action"] == "free", "block"]) <= allocs
    assert ev["block"][ev["action"] == "free"].is_unique


def test_graph_roundtrip(tmp_path):
    graph = trace_step(tiny_transformer(), StepSpec(batch_size=2))
    loaded = OpGraph.load(graph.save(tmp_path / "g"))
    assert loaded.nodes.equals(graph.nodes)
    assert loaded.edges.equals(graph.edges)
    assert loaded.mem_events.equals(graph.mem_events)
    again = OpGraph.from_json(graph.to_json())
    assert again.flops == graph.flops and again.num_ops == graph.num_ops
    assert len(graph.edges) > 0
    assert (graph.edges["src"] < graph.edges["dst"]).all()


def _mlp(name: str, make: Callable[[], nn.Module]) -> BuiltModel:
    """A module built on meta taking an (N, 8) input, with a squared-output loss."""
    with torch.device("meta"):
        module = make()
    return BuiltModel(
        ModelSpec(f"test:{name}"),
        module,
        "mlp",
        lambda step, device: {"input": torch.randn(step.batch_size, 8, device=device)},
        lambda out, inp: out.square().mean(),
        lambda m: None,
    )


def _dropout_model(inplace: bool) -> BuiltModel:
    return _mlp(
        "dropout",
        lambda: nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.1, inplace=inplace), nn.Linear(16, 4)),
    )


def test_dropout_traces_the_fused_cuda_kernel():
    # CUDA runs F.dropout as one native_dropout kernel: a float output and a bool mask
    # (4 + 1 bytes per element), where CPU would save a float noise tensor.
    graph = trace_step(_dropout_model(inplace=False), StepSpec(batch_size=4, optimizer="sgd"))
    ops = graph.nodes["op"]
    assert "bernoulli_" not in set(ops)
    fwd = graph.nodes[(ops == "native_dropout") & (graph.nodes["phase"] == "forward")]
    assert len(fwd) == 1 and (ops == "native_dropout_backward").sum() == 1
    ev = graph.mem_events
    made = ev[(ev["node_id"] == fwd.index[0]) & (ev["action"] == "alloc")]
    assert sorted(made["bytes"]) == [4 * 16 * 1, 4 * 16 * 4]


def test_inplace_dropout_keeps_the_generic_path():
    # In-place dropout is not fused on CUDA either: it multiplies by a float noise tensor.
    graph = trace_step(_dropout_model(inplace=True), StepSpec(batch_size=4, optimizer="sgd"))
    assert "bernoulli_" in set(graph.nodes["op"])
    assert "native_dropout" not in set(graph.nodes["op"])


class _TwoHeads(nn.Module):
    """``h`` feeds two layers, so backward sums two gradients for it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 3), nn.Linear(16, 3)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        h = self.a(input)
        return self.b(h) + self.c(h)


def test_engine_sums_gradients_in_place():
    # A plain run's autograd engine adds the second gradient of h into the first one's
    # block (InputBuffer: old.add_(new)); under a dispatch mode it would allocate a third.
    graph = trace_step(_mlp("two_heads", _TwoHeads), StepSpec(batch_size=4, optimizer="sgd"))
    ev, nodes = graph.mem_events, graph.nodes
    h_bytes = 4 * 16 * 4  # batch 4 x 16 floats; no weight or bias has this size
    backward_allocs = ev[(ev["phase"] == "backward") & (ev["action"] == "alloc")]
    assert (backward_allocs["bytes"] == h_bytes).sum() == 2  # one per incoming gradient
    sums = nodes[(nodes["phase"] == "backward") & (nodes["op"] == "add")]
    assert len(sums) == 1  # the kernel still runs ...
    assert sums.index[0] not in set(backward_allocs["node_id"])  # ... into an existing block
    allocs = set(ev.loc[ev["action"] == "alloc", "block"])
    assert set(ev.loc[ev["action"] == "free", "block"]) <= allocs
    assert ev["block"][ev["action"] == "free"].is_unique


def test_zero_grad_in_place_zeroes_each_gradient_and_accumulates_into_it():
    """PyTorch 1.x's zero_grad(set_to_none=False): one zero_ per parameter before the step,
    and backward adds every incoming gradient into the kept one (one add_ per parameter)."""
    n_params = sum(1 for _ in tiny_cnn().module.parameters())
    none = trace_step(tiny_cnn(), StepSpec(batch_size=2, optimizer="none"))
    zero = trace_step(tiny_cnn(), StepSpec(batch_size=2, optimizer="none", zero_grad="zero"))
    assert not (none.nodes["phase"] == "zero_grad").any()
    zeroed = zero.nodes[zero.nodes["phase"] == "zero_grad"]
    assert zeroed["op"].tolist() == ["zero_"] * n_params

    def backward_adds(g: OpGraph) -> int:
        return int(((g.nodes["phase"] == "backward") & g.nodes["op"].isin(["add", "add_"])).sum())

    assert backward_adds(zero) - backward_adds(none) == n_params
    # no gradient is freed in the step: they stay allocated from one step to the next
    ev = zero.mem_events
    grads = set(ev.loc[(ev["category"] == "gradient") & (ev["action"] == "alloc"), "block"])
    freed = set(ev.loc[ev["action"] == "free", "block"])
    assert grads and not grads & freed


def test_a_model_reading_a_tensor_value_says_so(tmp_path) -> None:
    """``.item()`` (or a branch on data) cannot run on fake tensors: the one-line error says
    what the model did, not only torch's DataDependentOutputException."""
    from zoo_helpers import linear_factory

    import boom_ml
    from boom_ml.errors import BoomError

    model = linear_factory(tmp_path, "y = self.fc(x)\nreturn y.sum() * float(y.max().item())")
    with pytest.raises(BoomError) as err:
        boom_ml.predict(model=model, gpu="l4", batch_size=2)
    assert "DataDependentOutputException" in str(err.value) and "\n" not in str(err.value)
    assert "(the model reads a tensor's value: .item(), a branch on data" in str(err.value)


def test_a_compiled_model_is_traced_as_its_eager_module_with_a_note(tmp_path) -> None:
    """``torch.compile`` on the model and on a child: both wrappers are taken off (the
    top-level one hid forward's argument names), the ops and parameters are the eager
    model's, and the notes say it was traced eager."""
    import boom_ml

    path = tmp_path / "compiled.py"
    path.write_text(
        "import torch\nfrom torch import nn\n\n\n"
        "class Model(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.layers = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))\n\n"
        "    def example_inputs(self, batch_size, device):\n"
        "        return {'x': torch.randn(batch_size, 8, device=device)}\n\n"
        "    def forward(self, x):\n        return self.layers(x)\n\n\n"
        "def eager():\n    return Model()\n\n\n"
        "def compiled():\n    model = Model()\n    model.layers[0] = torch.compile(model.layers[0])\n"
        "    return torch.compile(model)\n"
    )
    common = {"gpu": "l4", "batch_size": 2, "cache": False}
    plain = boom_ml.predict(model=f"file:{path}:eager", **common)
    wrapped = boom_ml.predict(model=f"file:{path}:compiled", **common)
    assert plain.graph["model_notes"] == []
    (note,) = wrapped.graph["model_notes"]
    assert note.startswith("torch.compile (2 compiled modules) traced as eager PyTorch")
    for key in ("num_ops", "flops", "num_parameters"):
        assert wrapped.graph[key] == plain.graph[key]
    assert wrapped.graph["num_parameters"] == 8 * 16 + 16 + 16 * 4 + 4


def test_a_compiled_child_used_twice_is_unwrapped_in_both_places() -> None:
    """named_children() lists a shared child once; its second place kept the wrapper."""
    import torch
    from torch import nn

    from boom_ml.zoo.common import uncompiled

    shared = torch.compile(nn.Linear(4, 4))
    model, count = uncompiled(nn.Sequential(shared, nn.ReLU(), shared))
    assert [type(m).__name__ for m in model] == ["Linear", "ReLU", "Linear"]
    assert model[0] is model[2] and count == 2


MLP = """
from torch import nn


def make():
    return nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))


def make_with_inputs():
    model = make()
    model.example_inputs = lambda batch_size, device: {"input": torch.randn(batch_size, 128)}
    return model


import torch
"""


def test_a_file_model_given_the_guessed_image_batch_is_told_of_example_inputs(tmp_path) -> None:
    from boom_ml.errors import TraceError

    path = tmp_path / "mlp.py"
    path.write_text(MLP)
    step = StepSpec(batch_size=2, image_size=32)
    with pytest.raises(TraceError) as err:
        trace_step(build_model(ModelSpec(f"file:{path}:make")), step)
    assert str(err.value).endswith(
        "(its batch was synthesised as input=(batch, 3, S, S) images; a model that takes "
        "other inputs defines example_inputs(batch_size, device) on the module)"
    )
    # with example_inputs the module gets its own batch, and the step traces
    graph = trace_step(build_model(ModelSpec(f"file:{path}:make_with_inputs")), step)
    assert graph.meta["num_trainable_parameters"] == 128 * 64 + 64 + 64 * 10 + 10
