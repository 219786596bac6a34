"""What a parallel layout refuses, in one line: outputs made for one GPU, keys it does not
read (``parallel.*`` and ``cluster.*``), bad keys and model names through the API, a link a GPU
lacks, and encoder-decoder models."""

from __future__ import annotations

import json
import re

import pytest

from boom_ml.errors import InvalidInputError
from boom_ml.parallel.layout import Layout, for_parallel_step


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"max_batch_on": True}, "max_batch=on"),
    ],  # fmt: skip
)
def test_single_gpu_outputs_are_refused_for_a_layout(kwargs, words) -> None:
    with pytest.raises(InvalidInputError) as err:
        for_parallel_step(Layout(dp=2), **kwargs)
    assert words in str(err.value) and "\n" not in str(err.value)
    for_parallel_step(Layout(), **kwargs)  # one GPU produces them


def test_the_cli_refuses_them_before_importing_torch() -> None:
    from boom_ml.predict import validate

    with pytest.raises(InvalidInputError, match="max_batch=on"):
        validate({"model": "hf:gpt2", "gpu": "l4", "parallel": {"dp": 2}, "max_batch": "on"})
    validate({"model": "hf:gpt2", "gpu": "l4", "parallel": {"dp": 2}, "explain": True})


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"parallel": {"dpp": 2}}, "unknown parallel option(s): dpp"),
        ({"cluster": {"gpu_per_node": 2}}, "unknown cluster option(s): gpu_per_node"),
        ({"moe": {"imbalanse": 3}}, "unknown moe option(s): imbalanse"),
        ({"moe": {"imbalance": 0.5}}, "moe.imbalance must be a number >= 1.0"),
        # the CLI's checks, from Python: a string is not a switch, a number not a mapping
        ({"tf32": "false"}, "tf32 must be true or false"),
        ({"tf32_matmul": "no"}, "tf32_matmul must be true or false"),
        ({"advice": "no"}, "advice must be true or false"),
        ({"cache": "offf"}, "cache must be on or off"),
        ({"moe": 2}, "moe must be a mapping of its options"),
        ({"parallel": 2}, "parallel must be a mapping of its options"),
        ({"finetune": "lora"}, "finetune must be a mapping of its options"),
        ({"plot": 5}, "plot must be a directory path"),
        ({"plot": ""}, "plot= needs a directory"),  # Path("") was the working directory
        ({"batch_size": 2**36}, "is above 2147483648 (2^31)"),  # a pandas overflow traceback
    ],  # fmt: skip
)
def test_the_api_names_bad_keys_in_one_line(kwargs, words) -> None:
    import boom_ml

    with pytest.raises(InvalidInputError) as err:
        boom_ml.predict("hf:gpt2", gpu="l4", **kwargs)
    assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("model", "words"),
    [(123, "model must be a name such as torchvision:resnet50, got 123"),
     (None, "got None"), ("torchvison:resnet50", "(did you mean: torchvision?)")],
)  # fmt: skip
def test_the_api_checks_the_model_name_as_the_cli_does(model, words) -> None:
    import boom_ml
    from boom_ml.errors import UnknownModelError

    with pytest.raises(UnknownModelError) as err:
        boom_ml.predict(model, gpu="l4")
    assert words in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(UnknownModelError, match=re.escape(words)):
        boom_ml.Session(model)  # public too


def test_a_link_a_gpu_lacks_is_refused_before_any_trace(monkeypatch) -> None:
    import boom_ml
    import boom_ml.parallel.predict as parallel_predict

    monkeypatch.setattr(parallel_predict, "predict_parallel", None)  # a call would fail
    with pytest.raises(InvalidInputError, match="t4 has no NVLink"):
        boom_ml.predict("hf:gpt2", gpu=["h100-sxm", "t4"], parallel={"dp": 2},
                        cluster={"intra": "nvlink"})  # fmt: skip


def test_an_encoder_decoder_is_refused_in_one_line() -> None:
    from boom_ml.parallel.shard import check_model, load_raw

    with pytest.raises(InvalidInputError, match="'t5' is an encoder-decoder") as err:
        check_model(load_raw("hf:t5-small"), Layout(dp=2))
    assert "\n" not in str(err.value)


def test_the_layout_search_says_why_it_cannot_cut_an_encoder_decoder() -> None:
    """The advisor's search raises the one line (its reason) before any trace, where each
    layout's refusal was swallowed and the advice came out empty."""
    from boom_ml.gpus import get_gpu
    from boom_ml.parallel.search import search_layouts_many
    from boom_ml.specs import StepSpec

    with pytest.raises(InvalidInputError, match="'t5' is an encoder-decoder"):
        search_layouts_many("hf:t5-small", [get_gpu("l4")], StepSpec(batch_size=2))


@pytest.mark.parametrize(
    ("parallel", "words"),
    [({"dp": 2, "schedule": "gpipe"}, "parallel.schedule=gpipe: this layout does not read it"),
     ({"dp": 2, "sharding": "zero1", "bucket_view": True}, "parallel.bucket_view=true: this"),
     ({"dp": 2, "grad_accumulation": "fused"}, "parallel.grad_accumulation=fused: this"),
     # no data parallelism, no DDP to take the option (it ran with exit 0, a hunt)
     ({"tp": 2, "bucket_view": True}, "parallel.bucket_view=true: this layout does not read it"
      " (it sets DDP's buckets, and parallel.dp=1 runs no DDP)"),
     # one GPU's micro-batches are its grad_accum, traced whole; these keys had switched it to
     # the layout model (15.1 GiB where grad_accum=4 gives 15.9; a hunt)
     ({"microbatches": 4, "bucket_view": True}, "parallel.bucket_view=true: for a multi-GPU"
      " layout (parallel.dp, tp or pp above 1); one GPU's step does not read it"
      " (parallel.microbatches=4 there is grad_accum=4)"),
     ({"microbatches": 4, "grad_accumulation": "fused"}, "parallel.grad_accumulation=fused: for")],
)  # fmt: skip
def test_a_layout_refuses_a_key_it_does_not_read(parallel, words) -> None:
    """A hunt: parallel.schedule=gpipe without a pipeline ran as 1F1B with exit 0, where one
    GPU's step refuses the same key; every key a layout would not read is one line now."""
    from boom_ml.predict import validate

    with pytest.raises(InvalidInputError) as err:
        validate({"model": "hf:gpt2", "gpu": "l4", "parallel": parallel})
    assert str(err.value).startswith(words) and "\n" not in str(err.value)
    read = {**parallel, "pp": 2} if "schedule" in parallel else None
    read = read or ({**parallel, "sharding": "none"} if "bucket_view" in parallel else None)
    read = {**(read or {**parallel, "microbatches": 2}), "dp": 2}
    validate({"model": "hf:gpt2", "gpu": "l4", "parallel": read})


@pytest.mark.parametrize(
    ("options", "words"),
    [({"cluster": {"gpus_per_node": 4}}, "cluster.gpus_per_node=4: for a multi-GPU layout"),
     ({"parallel": {"dp": 8}, "cluster": {"inter": "eth-25g"}},
      "cluster.inter=eth-25g: this layout does not read it (its 8 GPUs fit in one node")],
)  # fmt: skip
def test_cluster_keys_nothing_reads_are_refused(options, words) -> None:
    """A hunt: cluster.* ran with exit 0 where nothing read it (one GPU; a layout within one
    node and an inter-node link). advice=true reads them: its layout search places ranks."""
    from boom_ml.predict import validate

    base = {"model": "hf:gpt2", "gpu": "l4", "advice": False}
    with pytest.raises(InvalidInputError) as err:
        validate({**base, **options})
    assert str(err.value).startswith(words) and "\n" not in str(err.value)
    validate({**base, **options, "advice": True})
    if "parallel" in options:  # two nodes of 8 cross the link
        validate({**base, **options, "parallel": {"dp": 16}})


def test_zero_1_or_2_without_an_optimizer_is_refused() -> None:
    """optimizer=none under ZeRO-1 had been charged the all-gather of 4.7 GB of updated
    parameters that nothing updated (a hunt); ZeRO-3 and FSDP shard the parameters
    themselves, and take it."""
    from boom_ml.predict import validate

    base = {"model": "hf:gpt2", "gpu": "l4", "optimizer": "none"}
    for sharding in ("zero1", "zero2"):
        with pytest.raises(InvalidInputError, match=f"^parallel.sharding={sharding} shards the"):
            validate({**base, "parallel": {"dp": 2, "sharding": sharding}})
    validate({**base, "parallel": {"dp": 2, "sharding": "fsdp"}})
    validate({**base, "optimizer": "adamw", "parallel": {"dp": 2, "sharding": "zero1"}})


def test_cluster_keys_no_layout_search_read_are_said_under_advice(monkeypatch) -> None:
    """A hunt: with advice=true (the default) cluster.* keys were taken without a word where
    every GPU fit, so that no layout search ran to read them; the output now says so."""
    import boom_ml
    import boom_ml.parallel.predict as parallel_predict
    from boom_ml.report.table import render_table

    out = boom_ml.predict("torchvision:squeezenet1_1", gpu="l4", batch_size=1, image_size=32,
                          max_batch="off", cluster={"inter": "eth-25g", "gpus_per_node": 4})  # fmt: skip
    assert out.gpus[0].fits
    assert out.graph["unread"] == {"cluster.inter": "eth-25g", "cluster.gpus_per_node": 4}
    assert ("Not used: cluster.gpus_per_node=4, cluster.inter=eth-25g (one GPU's step does not"
            " read them") in " ".join(render_table(out).split())  # fmt: skip

    # a torchvision model's advice searches no layouts, so nothing reads them where it fails
    fails = boom_ml.predict("torchvision:squeezenet1_1", gpu="t4", batch_size=4096,
                            image_size=224, max_batch="off", cluster={"intra": "pcie"})  # fmt: skip
    assert not fails.gpus[0].fits and fails.graph["unread"] == {"cluster.intra": "pcie"}

    def fits(model, gpus, step, layout, nodes, stack=None, options=None):
        return [{"gpu": g.id, "fits": True, "notes": []} for g in gpus]

    monkeypatch.setattr(parallel_predict, "predict_parallel", fits)
    layout = boom_ml.predict(
        "hf:gpt2", gpu="l4", parallel={"dp": 2}, cluster={"inter": "roce-100g"}
    )
    assert layout.parallel[0]["notes"] == [
        "cluster.inter=roce-100g not used: this layout does not read it (its 2 GPUs fit in one node"
        " of cluster.gpus_per_node=8), and advice=true searches layouts, which read it, only"
        " where the layout does not fit"
    ]


@pytest.mark.parametrize(
    ("raw", "words"),
    [({"model_type": "swin", "embed_dim": 96, "depths": [2, 2, 6, 2],
       "num_heads": [3, 6, 12, 24]},
      "'swin': its layers come in stages of different sizes (num_heads=[3, 6, 12, 24])"),
     ({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4},
      "'llama': its config names no layer count (num_hidden_layers / n_layer / num_layers; the"
      " class default applies on one GPU): set one with model_options.num_hidden_layers=N"),
     ({"model_type": "albert", "hidden_size": 64, "num_attention_heads": 4,
       "num_hidden_layers": 12, "num_hidden_groups": 1},
      "'albert': its 12 layers share the weights of 1 (num_hidden_groups)")],
)  # fmt: skip
def test_a_config_that_is_not_one_stack_of_equal_layers_is_refused(raw, words, tmp_path) -> None:
    """A hunt: Swin's per-stage heads and a config without a layer count had been
    tracebacks under parallel.dp=2 (TypeError in the layout's checks), and ALBERT's shared
    layers had been counted as 4.1 M parameters where it has 11.2 M (its DDP all-reduce 2.7x
    too small)."""
    from boom_ml.parallel.layout import Layout
    from boom_ml.parallel.shard import check_model, config_facts

    with pytest.raises(InvalidInputError) as err:
        check_model(raw, Layout(dp=2))
    assert str(err.value) == (
        f"parallel layouts cut one stack of equal layers; {words}; predict it on one GPU"
    )
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    assert config_facts(f"hf:{path}") == {}  # the checks before torch leave it to check_model


@pytest.mark.parametrize("sharding", ["zero2", "zero3", "fsdp"])
def test_fused_accumulation_is_refused_where_gradients_are_sharded(sharding) -> None:
    """Megatron-LM's fusion adds each weight gradient into a whole main_grad inside its GEMM;
    ZeRO-2 and FSDP2 keep sharded gradients. It had been taken there and dropped every
    gradient add without a word (a hunt); ZeRO-1 (Megatron's distributed optimizer) keeps it."""
    from boom_ml.predict import validate

    parallel = {"dp": 2, "microbatches": 2, "grad_accumulation": "fused"}
    with pytest.raises(InvalidInputError) as err:
        validate({"model": "hf:gpt2", "gpu": "l4", "parallel": {**parallel, "sharding": sharding}})
    assert str(err.value).startswith(
        "parallel.grad_accumulation=fused is Megatron-LM's gradient accumulation fusion"
    ) and f"parallel.sharding={sharding} keeps sharded gradients" in str(err.value)
    validate({"model": "hf:gpt2", "gpu": "l4", "parallel": {**parallel, "sharding": "zero1"}})
