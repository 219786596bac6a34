"""Each time estimate says whether its GPU, or the GPU's architecture, was measured."""

from __future__ import annotations

import pandas as pd

from boom_ml.gpus import get_gpu
from boom_ml.report.table import basis_line
from boom_ml.specs import StepSpec
from boom_ml.timing.basis import ARCHITECTURE, MEASURED, UNMEASURED, basis, measured_gpus
from boom_ml.timing.estimate import estimate_times
from boom_ml.trace.step import trace_step
from tests.tiny_models import tiny_cnn


def test_basis_by_gpu_then_architecture() -> None:
    measured = ["a100-80gb-pcie", "t4"]
    assert basis(get_gpu("a100-80gb-pcie"), measured) == MEASURED
    assert basis(get_gpu("a100-80gb-sxm"), measured) == ARCHITECTURE  # ampere, measured
    assert basis(get_gpu("rtx-2080-ti"), measured) == ARCHITECTURE  # turing, as the T4
    assert basis(get_gpu("h100-sxm"), measured) == UNMEASURED
    assert basis(get_gpu("v100-pcie-32gb"), measured) == UNMEASURED


def test_packaged_heads_measured_no_hopper_gpu() -> None:
    measured = measured_gpus()
    assert "a100-80gb-pcie" in measured and "l4" in measured
    assert {get_gpu(g).architecture for g in measured}.isdisjoint({"hopper", "blackwell"})


def test_estimates_carry_their_basis_and_the_table_names_new_architectures(monkeypatch) -> None:
    monkeypatch.setattr("boom_ml.timing.estimate.measured_gpus", lambda: ["t4"])
    graph = trace_step(tiny_cnn(), StepSpec(batch_size=2, image_size=32, optimizer="sgd"))
    ids = ["t4", "rtx-2080-ti", "h100-sxm", "h200", "b200"]
    ests = estimate_times(graph, [get_gpu(g) for g in ids])
    assert [e.basis for e in ests] == [MEASURED, ARCHITECTURE, UNMEASURED, UNMEASURED, UNMEASURED]
    line = basis_line([(g, e.basis) for g, e in zip(ids, ests, strict=True)])
    assert line.startswith(
        "Time on h100-sxm, h200, b200 extrapolates: no GPU of their architecture"
    )
    assert basis_line([("t4", MEASURED), ("rtx-2080-ti", ARCHITECTURE), ("h100-sxm", None)]) == ""
    monkeypatch.setattr("boom_ml.timing.estimate.measured_gpus", lambda: [])
    assert estimate_times(graph, [get_gpu("t4")])[0].basis is None  # no heads: no basis


def test_a_gpu_from_a_yaml_file_gets_the_note_too() -> None:
    """A user's own GPU has no database entry: the note must not look it up by id."""
    from pathlib import Path

    from boom_ml.predict import run

    yaml = Path(__file__).resolve().parent.parent / "configs" / "gpus" / "example_unreleased.yaml"
    text = run({"model": "torchvision:resnet18", "gpu": str(yaml), "batch_size": 2,
                "image_size": 32, "advice": False, "cache": False})  # fmt: skip
    assert "Time on hypothetical-x1 extrapolates: no GPU of its architecture" in text


def test_bf16_on_a_gpu_without_bf16_tensor_cores_is_said() -> None:
    """bf16 tensor cores came with Ampere: a T4 or V100 runs a bf16 step's matmuls at its fp32
    rate, and the table says so; an A100 or L4 runs them on tensor cores; a step without bf16
    carries no flag."""
    from boom_ml import api
    from boom_ml.report.table import render_table

    assert [get_gpu(g).bf16_tensor_cores for g in ("t4", "v100-pcie-32gb", "a100-80gb-sxm", "l4")] == [
        False, False, True, True]  # fmt: skip
    assert get_gpu("t4").bf16_peak_tflops == get_gpu("t4").fp32_tflops
    kw = {"batch_size": 2, "image_size": 32, "advice": False, "cache": False, "max_batch": False}
    p = api.predict("torchvision:resnet18", gpu=["t4", "a100-80gb-sxm"], amp="bf16", **kw)
    assert [g.time.bf16_tensor_cores for g in p.gpus] == [False, True]
    assert "bf16 on t4: no bf16 tensor cores (before Ampere)" in render_table(p)
    plain = api.predict("torchvision:resnet18", gpu=["t4"], **kw)
    assert plain.gpus[0].time.bf16_tensor_cores is None
    assert "bf16 tensor cores" not in render_table(plain)


def test_a_yaml_spec_that_takes_a_measured_gpus_id_is_not_measured(tmp_path) -> None:
    """basis 'measured' is for the packaged spec whose kernels were measured, not for any
    spec that happens to carry its id."""
    from boom_ml.gpus import get_gpu as lookup
    from boom_ml.timing.basis import ARCHITECTURE, MEASURED, basis

    measured = ["a100-80gb-pcie"]
    spec = tmp_path / "mine.yaml"
    spec.write_text("id: a100-80gb-pcie\nname: mine\narchitecture: ampere\n"
                    "compute_capability: '8.0'\nsm_count: 10\nmemory_gb: 8\n"
                    "memory_bandwidth_gbs: 100\nfp32_tflops: 1\n")  # fmt: skip
    assert basis(lookup("a100-80gb-pcie"), measured) == MEASURED
    assert basis(lookup(str(spec)), measured) == ARCHITECTURE


def test_half_precision_kernels_no_gpu_of_the_architecture_measured() -> None:
    """A step's fp16/bf16 GEMMs and convolutions, named per GPU where no GPU of its
    architecture had them measured in fp16 (the packaged heads: fp16 GEMMs on Pascal, Volta,
    Turing and Ampere GPUs; fp16 convolutions on Pascal, Volta and Turing only)."""
    from boom_ml.report.table import half_line
    from boom_ml.timing.basis import half_coverage, half_kinds, unmeasured_half

    coverage = half_coverage()
    assert coverage["gemm"] == {"a100-80gb-pcie", "a40", "p100-pcie-16gb", "t4", "v100-sxm2-16gb"}
    assert coverage["conv"] == {"p100-pcie-16gb", "t4", "v100-sxm2-16gb"}
    both = ["gemm", "conv"]
    assert unmeasured_half(get_gpu("rtx-4090"), both, coverage) == [
        "fp16/bf16 GEMMs", "fp16/bf16 convolutions"]  # fmt: skip
    assert unmeasured_half(get_gpu("a100-80gb-sxm"), both, coverage) == ["fp16/bf16 convolutions"]
    assert unmeasured_half(get_gpu("rtx-2080-ti"), both, coverage) == []  # Turing, as the T4
    assert unmeasured_half(get_gpu("rtx-4090"), both, {}) == []  # a model without the record
    # SYNTHETIC node tables: an AMP conv (fp16 inputs), an fp32 GEMM, a bf16 GEMM
    conv = {"family": "conv", "input_dtypes": '["float16", "float16"]'}
    fp32 = {"family": "gemm", "input_dtypes": '["float32", "float32"]'}
    bf16 = {"family": "gemm", "input_dtypes": '["bfloat16", "bfloat16"]'}
    assert half_kinds(pd.DataFrame([conv, fp32])) == ["conv"]
    assert half_kinds(pd.DataFrame([fp32, bf16, conv])) == ["gemm", "conv"]
    assert half_kinds(pd.DataFrame([fp32])) == []
    assert unmeasured_half(get_gpu("h100-sxm"), both, coverage) == [
        "fp16/bf16 GEMMs", "fp16/bf16 convolutions"]  # fmt: skip
    gemm_conv, conv = ["fp16/bf16 GEMMs", "fp16/bf16 convolutions"], ["fp16/bf16 convolutions"]
    line = half_line([("rtx-4090", gemm_conv, ARCHITECTURE), ("a100-80gb-sxm", conv, ARCHITECTURE),
                      ("l4", gemm_conv, MEASURED), ("t4", [], MEASURED),
                      ("h100-sxm", gemm_conv, UNMEASURED)])  # fmt: skip
    assert line.startswith(
        "No GPU of the same architecture was measured running these in fp16: fp16/bf16 GEMMs and "
        "convolutions on rtx-4090, l4; convolutions on a100-80gb-sxm. Their times come from other "
        "GPUs' kernels and are likely too high"
    )
    assert half_line([("t4", [], MEASURED), ("h100-sxm", gemm_conv, UNMEASURED)]) == ""


def test_an_amp_prediction_names_its_unmeasured_half_precision_kernels() -> None:
    """End to end: an AMP CNN step on an RTX 4090, an A100 and an H100 (the H100's whole
    architecture is unmeasured: its JSON lists both kinds, and the basis line says it)."""
    from boom_ml import api
    from boom_ml.report.table import render_table

    kw = {"batch_size": 2, "image_size": 32, "advice": False, "cache": False, "max_batch": False}
    p = api.predict("torchvision:resnet18", gpu=["rtx-4090", "a100-80gb-sxm", "h100-sxm"],
                    amp="fp16", **kw)  # fmt: skip
    both = ["fp16/bf16 GEMMs", "fp16/bf16 convolutions"]
    assert [g.time.unmeasured_kernels for g in p.gpus] == [both, both[1:], both]
    assert p.to_dict()["gpus"][1]["time"]["unmeasured_kernels"] == ["fp16/bf16 convolutions"]
    text = render_table(p)
    assert (
        "in fp16: fp16/bf16 GEMMs and convolutions on rtx-4090; convolutions on a100-80gb-sxm."
    ) in text  # the H100: "Time on h100-sxm extrapolates" says it for every kernel
    assert "Time on h100-sxm extrapolates" in text
    fp32 = api.predict("torchvision:resnet18", gpu=["rtx-4090"], **kw)
    assert fp32.gpus[0].time.unmeasured_kernels == []


def test_a_layout_names_a_vits_patch_convolution_too() -> None:
    """A multi-GPU layout times 1- and 2-layer traces: their half-precision gaps are the
    estimate's, so a ViT's patch convolution counts as it does on one GPU (a helper found the
    layout had assumed GEMMs only)."""
    import json

    from boom_ml.predict import run

    base = {"model": "hf:google/vit-base-patch16-224", "gpu": ["rtx-4090", "a100-80gb-sxm"],
            "batch_size": 4, "amp": "fp16", "advice": False, "cache": False}  # fmt: skip
    one = json.loads(run({**base, "output": "json"}))
    two = json.loads(run({**base, "output": "json", "parallel": {"dp": 2}}))
    kinds = [g["time"]["unmeasured_kernels"] for g in one["gpus"]]
    assert kinds == [["fp16/bf16 GEMMs", "fp16/bf16 convolutions"], ["fp16/bf16 convolutions"]]
    assert [g["time"]["unmeasured_kernels"] for g in two["parallel"]] == kinds


def test_the_table_says_why_a_gpu_has_no_price() -> None:
    """The $ column's "-" on consumer cards had no word under the table (a helper's hunt)."""
    from boom_ml import api
    from boom_ml.report.table import render_table

    kw = {"batch_size": 2, "image_size": 32, "advice": False, "cache": False, "max_batch": False}
    p = api.predict("torchvision:resnet18", gpu=["rtx-4090", "rtx-3090", "a100-80gb-sxm"], **kw)
    assert [g.price_usd_per_hour is None for g in p.gpus] == [True, True, False]
    assert "$ / 1k steps: no observed cloud price for rtx-4090, rtx-3090 (gpus/prices.csv" in (
        render_table(p))  # fmt: skip
    priced = api.predict("torchvision:resnet18", gpu=["a100-80gb-sxm"], **kw)
    assert "no observed cloud price" not in render_table(priced)


def test_a_bf16_layout_on_a_gpu_without_bf16_tensor_cores_is_said() -> None:
    """The one-GPU table's bf16 line was missing under a layout (a helper's hunt)."""
    import json

    from boom_ml.predict import run

    base = {"model": "hf:HuggingFaceTB/SmolLM2-135M", "gpu": ["t4", "a100-80gb-sxm"],
            "batch_size": 1, "seq_len": 128, "amp": "bf16", "advice": False, "cache": False,
            "parallel": {"dp": 2}}  # fmt: skip
    assert "bf16 on t4: no bf16 tensor cores (before Ampere)" in run(base)
    out = json.loads(run({**base, "output": "json"}))
    assert [g["time"]["bf16_tensor_cores"] for g in out["parallel"]] == [False, True]
    plain = json.loads(run({**base, "amp": "none", "output": "json"}))
    assert "bf16_tensor_cores" not in plain["parallel"][0]["time"]


def test_a_bf16_step_on_a_t4_says_its_attention_runs_the_math_path() -> None:
    """SDPA's fused kernels take bf16 from sm80 only: a bf16 QLoRA step of gpt2-medium on a
    T4 held 4.9 GiB where fp16 held 2.5, and the table said nothing of why (a hunt). Every
    step now lists its attention's kernels per GPU; a CNN has none."""
    from boom_ml import api
    from boom_ml.report.table import render_table

    kw = {"batch_size": 1, "seq_len": 64, "advice": False, "cache": False, "max_batch": False,
          "model_options": {"n_layer": 2}}  # fmt: skip
    p = api.predict("hf:gpt2", gpu=["t4", "a100-80gb-sxm"], params_dtype="bf16", **kw)
    assert [g.time.attention_backends for g in p.gpus] == [{"math": 2}, {"flash": 2}]
    assert "Nor has SDPA a fused bf16 kernel on t4: attention runs its math path" in (
        render_table(p))  # fmt: skip
    half = api.predict("hf:gpt2", gpu=["t4"], params_dtype="fp16", **kw)
    assert half.gpus[0].time.attention_backends == {"efficient": 2}
    cnn = api.predict("torchvision:resnet18", gpu=["t4"], amp="bf16", batch_size=2,
                      image_size=32, advice=False, cache=False, max_batch=False)  # fmt: skip
    assert cnn.gpus[0].time.attention_backends == {}
    assert "Nor has SDPA" not in render_table(cnn)


def test_a_16_bit_step_timed_by_another_method_than_fp32_says_so() -> None:
    """MobileNetV3 at 64: AMP came out slower than fp32 on every GPU (T4 199.7 against 137.6
    ms; a hunt), the AMP step timed per-op and the fp32 one by the GNN, each where it won its
    cell of the CV. Each estimate now carries its per-op sum, which is like for like (AMP's is
    below fp32's), and a 16-bit step says which method an fp32 one gets."""
    from boom_ml import api
    from boom_ml.report.table import render_table

    kw = {"gpu": ["t4"], "batch_size": 64, "advice": False, "cache": False, "max_batch": False}
    fp32 = api.predict("torchvision:mobilenet_v3_large", **kw).gpus[0].time
    amp = api.predict("torchvision:mobilenet_v3_large", amp="fp16", **kw)
    half = amp.gpus[0].time
    assert (fp32.method, half.method, half.fp32_method, fp32.fp32_method) == (
        "gnn", "per-op", "gnn", "")  # fmt: skip
    assert half.per_op_ms == half.step_ms and half.per_op_ms < fp32.per_op_ms
    assert fp32.per_op_ms != fp32.step_ms  # the GNN's step, beside its per-op sum
    assert "Time: this 16-bit step is timed by the per-op sum, an fp32 step of this model by " \
        "the GNN" in render_table(amp)  # fmt: skip
    accumulated = api.predict("torchvision:mobilenet_v3_large", amp="fp16", grad_accum=2, **kw)
    assert accumulated.gpus[0].time.per_op_ms == accumulated.gpus[0].time.step_ms
