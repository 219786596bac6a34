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
    assert "fp16_tflops, bf16_tflops not given: from a rate given, by the ratio" in ampere.source
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


def test_a_given_rate_sets_the_others_by_the_ratio_its_sm_shows(tmp_path):
    """An A10G written out with fp16 alone (70 TFLOPS): bf16 and TF32 follow it as on every
    packaged compute-capability-8.6 GPU that lists both (bf16 = fp16, TF32 half), where the
    per-SM-and-MHz rule had put bf16 at 105, above the fp16 given. A GTX 1080 Ti's SM (6.1)
    lists no fp16 tensor rate on any packaged GPU: none is borrowed from the P100's (6.0)."""
    import statistics

    from boom_ml.gpus import all_gpus, get_gpu

    body = ("name: mine\narchitecture: {arch}\ncompute_capability: '{cc}'\nsm_count: {sm}\n"
            "memory_gb: 24\nmemory_bandwidth_gbs: 600\nfp32_tflops: {fp32}\n")  # fmt: skip
    (tmp_path / "a10g.yaml").write_text(body.format(arch="ampere", cc="8.6", sm=80, fp32=31.2)
                                        + "fp16_tflops: 70\n")  # fmt: skip
    mine = get_gpu(str(tmp_path / "a10g.yaml"))
    sm86 = [g for g in all_gpus() if g.compute_capability == "8.6" and g.fp16_tflops]
    tf32 = statistics.median(g.tf32_tflops / g.fp16_tflops for g in sm86 if g.tf32_tflops)
    assert mine.fp16_tflops == mine.bf16_tflops == 70.0
    assert mine.tf32_tflops == round(70 * tf32, 1) and 0.49 < tf32 < 0.51
    (tmp_path / "gp102.yaml").write_text(body.format(arch="pascal", cc="6.1", sm=28, fp32=11.3))
    assert get_gpu(str(tmp_path / "gp102.yaml")).fp16_tflops is None


def test_an_sm_no_packaged_gpu_has_takes_its_major_versions(tmp_path):
    """A compute-capability-10.3 part (B300-like: no packaged GPU has that SM) takes the rate
    per SM and MHz of the 10.0 B200, not the median with the 12.0 cards' (8x lower)."""
    from boom_ml.gpus import get_gpu

    b200 = get_gpu("b200")  # no boost clock listed: it and the spec count at one median clock
    (tmp_path / "b300.yaml").write_text(
        "name: mine\narchitecture: blackwell\ncompute_capability: '10.3'\nsm_count: 148\n"
        "memory_gb: 288\nmemory_bandwidth_gbs: 8000\nfp32_tflops: 75\n"
    )
    mine = get_gpu(str(tmp_path / "b300.yaml"))
    assert b200.sm_count == 148 and mine.fp16_tflops == b200.fp16_tflops == 2250.0
