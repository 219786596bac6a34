"""A GPU YAML's numbers are checked before use: in range, in their field's unit, memory sizes
that agree (each case below once loaded and predicted without a word)."""

from __future__ import annotations

import pytest

from boom_ml.errors import InvalidInputError
from boom_ml.gpus import get_gpu

BODY = ("name: mine\narchitecture: ampere\ncompute_capability: '8.0'\nsm_count: 108\n"
        "memory_gb: 80\nmemory_bandwidth_gbs: 2039\nfp32_tflops: 19.5\n")  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ("memory_bytes: -1\n", "field 'memory_bytes' must be positive, got -1"),
        ("total_memory_bytes: 0\n", "field 'total_memory_bytes' must be positive, got 0"),
        ("tdp_w: -5\n", "field 'tdp_w' must be positive, got -5.0"),
        ("l2_cache_mb: -40\n", "field 'l2_cache_mb' must be positive"),
        ("boost_clock_mhz: 0\n", "field 'boost_clock_mhz' must be positive"),
        ("price_usd_per_hour: -2\n", "'price_usd_per_hour' must be zero (not given) or positive"),
        ("fp16_tflops: -312\n", "'fp16_tflops' must be zero (not given) or positive, got -312.0"),
        ("tdp_w: true\n", "field 'tdp_w' must be a number, got True"),
        # a unit slip: TB/s, GHz, FLOPS, bytes
        ("l2_cache_mb: 41943040\n", "field 'l2_cache_mb' is 4.1943e+07, outside 0.1-2560"),
        ("boost_clock_mhz: 1.41\n", "is it in MHz?"),
        ("fp16_tflops: 312000000000000\n", "is it in TFLOPS?"),
        ("memory_bytes: 8589934592\n", "memory_bytes 8589934592 is not memory_gb 80 in bytes"),
        ("total_memory_bytes: 90000000000\n", "exceeds memory_gb 80 (85899345920 bytes)"),
        # a hunt: bytes as a float, 25769803776.0
        (
            "memory_bytes: 85899345920.0\ntotal_memory_bytes: 9e10\n",
            "total_memory_bytes 90000000000 (what PyTorch reports usable) exceeds memory_bytes"
            " 85899345920",
        ),
        # a hunt: a tensor-core rate below fp32's (a TF32 rate had been derived from it)
        (
            "fp16_tflops: 10\n",
            "field 'fp16_tflops' is 10, below fp32_tflops 19.5; compute"
            " capability 8.0 runs it on tensor cores",
        ),
        ("tf32_tflops: 19.4\n", "field 'tf32_tflops' is 19.4, below fp32_tflops 19.5"),
        # a hunt: TDP in kW, and CUDA cores as SMs (below), loaded and timed without a word
        ("tdp_w: 0.4\n", "field 'tdp_w' is 0.4, outside 3.5-20000"),
    ],
)
def test_a_number_out_of_range_is_one_line_naming_its_field(tmp_path, extra, words) -> None:
    path = tmp_path / "gpu.yaml"
    path.write_text(BODY + extra)
    with pytest.raises(InvalidInputError) as err:
        get_gpu(str(path))
    assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("field", "value", "unit"),
    [
        ("memory_bandwidth_gbs", "2.039", "GB/s"),
        ("memory_gb", "85899345920", "GB"),
        ("fp32_tflops", "19500000000000", "TFLOPS"),
        ("sm_count", "true", None),
        ("sm_count", "6912", "SMs (streaming multiprocessors, not CUDA cores)"),
    ],  # fmt: skip
)
def test_a_required_field_in_another_unit_is_refused(tmp_path, field, value, unit) -> None:
    path = tmp_path / "gpu.yaml"
    path.write_text("\n".join(line if not line.startswith(f"{field}:") else f"{field}: {value}"
                              for line in BODY.splitlines()))  # fmt: skip
    with pytest.raises(InvalidInputError, match=f"field '{field}'") as err:
        get_gpu(str(path))
    assert unit is None or f"is it in {unit}" in str(err.value)


def test_every_packaged_gpu_passes_the_checks_a_yaml_copy_gets(tmp_path) -> None:
    """The ranges come from the packaged GPUs: each of them, written out, loads as itself (but
    for the tensor-core rates the table leaves blank, which a user spec has filled)."""
    import yaml

    from boom_ml.gpus import all_gpus
    from boom_ml.gpus.tensor_rates import TENSOR_RATES

    for gpu in all_gpus():
        path = tmp_path / f"{gpu.id}.yaml"
        path.write_text(yaml.safe_dump(gpu.to_dict()))
        loaded = get_gpu(str(path)).to_dict()
        blank = {f for f in TENSOR_RATES if getattr(gpu, f) is None}
        kept = {k: v for k, v in gpu.to_dict().items() if k not in blank | {"source"}}
        assert {k: loaded[k] for k in kept} == kept, gpu.id


def test_a_spec_without_tensor_rates_gets_bf16_equal_to_fp16(tmp_path) -> None:
    """fp16 from the per-SM median, the others by the ratios the same SMs show (each from its
    own median, an RTX 3090-like 8.6 spec had fp16 73.0 and bf16 109.4: bf16 timed faster)."""
    from boom_ml.gpus import all_gpus

    path = tmp_path / "gpu.yaml"
    path.write_text("name: mine\narchitecture: ampere\ncompute_capability: '8.6'\nsm_count: 84\n"
                    "memory_gb: 24\nmemory_bandwidth_gbs: 936\nfp32_tflops: 35.6\n")  # fmt: skip
    spec = get_gpu(str(path))
    same_sm = [g for g in all_gpus() if g.compute_capability == "8.6" and g.bf16_tflops]
    assert all(g.bf16_tflops == g.fp16_tflops for g in same_sm) and same_sm
    assert spec.bf16_tflops == spec.fp16_tflops > spec.fp32_tflops
    assert spec.tf32_tflops == pytest.approx(spec.fp16_tflops / 2, abs=0.1)
