"""A user GPU YAML without tensor-core rates: filled from the packaged GPUs of its SM."""

from __future__ import annotations


def test_a_yaml_spec_without_tensor_rates_gets_its_architectures(tmp_path):
    """A compute-capability-8.0 spec with fp32_tflops alone: its fp16 / bf16 / TF32 rates come
    from the packaged 8.0 GPUs per SM and MHz (were timed at the fp32 rate), and the source
    says so; a Turing spec gets no bf16 rate (no packaged Turing GPU has one)."""
    from boom_ml.gpus import get_gpu

    body = ("name: mine\narchitecture: {arch}\ncompute_capability: '{cc}'\nsm_count: 108\n"
            "boost_clock_mhz: 1410\nmemory_gb: 80\nmemory_bandwidth_gbs: 2039\nfp32_tflops: 19.5\n")  # fmt: skip
    (tmp_path / "amp.yaml").write_text(body.format(arch="ampere", cc="8.0"))
    (tmp_path / "tur.yaml").write_text(body.format(arch="turing", cc="7.5"))
    ampere, turing = get_gpu(str(tmp_path / "amp.yaml")), get_gpu(str(tmp_path / "tur.yaml"))
    a100 = get_gpu("a100-80gb-sxm")  # compute capability 8.0, 108 SMs at 1410 MHz: its rates
    assert (ampere.tf32_tflops, ampere.fp16_tflops, ampere.bf16_tflops) == (
        a100.tf32_tflops, a100.fp16_tflops, a100.bf16_tflops)  # fmt: skip
    assert ampere.fp8_tflops is None
    assert "fp16_tflops, bf16_tflops not given: the median rate per SM and MHz" in ampere.source
    assert turing.fp16_tflops > turing.fp32_tflops and turing.bf16_tflops is None
    given = tmp_path / "given.yaml"
    given.write_text(body.format(arch="ampere", cc="8.0") + "fp16_tflops: 312\n")
    assert get_gpu(str(given)).fp16_tflops == 312.0  # a given rate is kept


def test_a_yaml_spec_without_its_usable_memory_loses_what_its_architecture_loses(tmp_path):
    """memory_gb 80 alone counted all 80 GiB as usable (the packaged A100-80GB SXM has
    79.3 of them): without total_memory_bytes a spec takes the median share the packaged
    GPUs of its architecture report; a given total is kept."""
    import statistics

    from boom_ml.gpus import all_gpus, get_gpu

    body = ("name: mine\narchitecture: ampere\ncompute_capability: '8.0'\nsm_count: 108\n"
            "memory_gb: 80\nmemory_bandwidth_gbs: 2039\nfp32_tflops: 19.5\n")  # fmt: skip
    (tmp_path / "mine.yaml").write_text(body)
    mine = get_gpu(str(tmp_path / "mine.yaml"))
    shares = [g.total_memory_bytes / g.memory_bytes for g in all_gpus()
              if g.architecture == "ampere" and g.total_memory_bytes]  # fmt: skip
    assert len(shares) >= 5 and mine.memory_bytes == 80 * 2**30
    assert mine.capacity_bytes == int(80 * 2**30 * statistics.median(shares))
    assert 0.95 * 80 * 2**30 < mine.capacity_bytes < 80 * 2**30
    assert "median share the packaged ampere GPUs report" in mine.capacity_source
    (tmp_path / "given.yaml").write_text(body + "total_memory_bytes: 85000000000\n")
    assert get_gpu(str(tmp_path / "given.yaml")).capacity_bytes == 85_000_000_000
