"""Tests for the packaged GPU spec database (boom_ml.gpus)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from boom_ml.errors import BoomError, UnknownGpuError
from boom_ml.gpus import (
    GpuSpec,
    all_gpus,
    get_gpu,
    gpu_aliases,
    parse_gpu_list,
    resolve_gpu_id,
)
from boom_ml.gpus.__main__ import main as cli_main
from boom_ml.gpus.spec import GIB

REPO = Path(__file__).resolve().parents[1]
EXAMPLE_YAML = REPO / "configs" / "gpus" / "example_unreleased.yaml"

# Ids the CLI examples and the issue name explicitly.
REQUIRED_IDS = [
    "p4", "p100-pcie-16gb", "v100-pcie-16gb", "v100-pcie-32gb", "v100-sxm2-16gb",
    "v100-sxm2-32gb", "t4", "a100-40gb-pcie", "a100-40gb-sxm", "a100-80gb-pcie", "a100-80gb-sxm",
    "h100-pcie", "h100-sxm", "h100-nvl", "h200", "h20", "b200", "l4", "l40", "l40s", "a10", "a10g",
    "a30", "a40", "rtx-2080-ti", "rtx-3090", "rtx-3060", "rtx-4090", "rtx-5090", "rtx-a6000",
    "rtx-6000-ada", "quadro-rtx-8000", "quadro-rtx-6000", "titan-rtx", "titan-xp", "titan-v",
    "gtx-1080-ti", "gh200", "rtx-pro-6000-blackwell-max-q",
]  # fmt: skip

# Device-name strings that appear in the project's measurement data, and what they must map to.
DEVICE_NAMES = {
    "Tesla P4": "p4",
    "Tesla P100-PCIE-16GB": "p100-pcie-16gb",
    "Tesla T4": "t4",
    "Tesla V100-PCIE-32GB": "v100-pcie-32gb",
    "NVIDIA A100-PCIE-40GB": "a100-40gb-pcie",
    "NVIDIA A100 80GB PCIe": "a100-80gb-pcie",
    "NVIDIA L4": "l4",
    "A100-SXM4-40GB": "a100-40gb-sxm",
    "TITAN RTX": "titan-rtx",
    "TITAN Xp": "titan-xp",
    "TITAN V": "titan-v",
    "GeForce RTX 2080 Ti": "rtx-2080-ti",
    "GeForce GTX 1080 Ti": "gtx-1080-ti",
    "NVIDIA GeForce RTX 3060": "rtx-3060",
    "RTX 3090": "rtx-3090",
    "NVIDIA H100 80GB HBM3": "h100-sxm",
    "NVIDIA H200": "h200",
    "NVIDIA GeForce RTX 4090": "rtx-4090",
    "NVIDIA GeForce RTX 5090": "rtx-5090",
    "NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition": "rtx-pro-6000-blackwell-max-q",
    "NVIDIA GH200 480GB": "gh200",
    "Quadro RTX 6000": "quadro-rtx-6000",
    "NVIDIA A40": "a40",
    "NVIDIA A100-SXM4-80GB": "a100-80gb-sxm",
    "NVIDIA H100 PCIe": "h100-pcie",
    # case, spacing and brand prefixes must not matter
    "tesla t4": "t4",
    "nvidia geforce rtx 3090": "rtx-3090",
    "  NVIDIA   L4  ": "l4",
    "A100_SXM4_40GB": "a100-40gb-sxm",
    # folder names in shared/data (NeuSight labels, timm_bench, cnn_step_times)
    "NVIDIA_A100_80GB_PCIe": "a100-80gb-pcie",
    "NVIDIA_A100-PCIE-40GB": "a100-40gb-pcie",
    "NVIDIA_A100-SXM4-40GB": "a100-40gb-sxm",
    "NVIDIA_H100_80GB_HBM3": "h100-sxm",
    "NVIDIA_L4": "l4",
    "Tesla_P100-PCIE-16GB": "p100-pcie-16gb",
    "Tesla_P4": "p4",
    "Tesla_T4": "t4",
    "Tesla_V100-PCIE-32GB": "v100-pcie-32gb",
    "TitanRTX": "titan-rtx",
    "TITANXP": "titan-xp",
    "TitanV": "titan-v",
    "1080TI": "gtx-1080-ti",
    "2080TI": "rtx-2080-ti",
    "pro6000maxq": "rtx-pro-6000-blackwell-max-q",
    "NVIDIA-GeForce-RTX-3060": "rtx-3060",
}


# ----------------------------------------------------------------------------- table contents


def test_table_has_at_least_40_unique_gpus():
    gpus = all_gpus()
    assert len(gpus) >= 40
    assert len({g.id for g in gpus}) == len(gpus)


def test_required_ids_exist():
    ids = {g.id for g in all_gpus()}
    assert not set(REQUIRED_IDS) - ids


def test_ids_are_lowercase_hyphenated():
    for g in all_gpus():
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", g.id), g.id


@pytest.mark.parametrize("gpu", all_gpus(), ids=lambda g: g.id)
def test_every_row_is_sourced_and_has_core_fields(gpu: GpuSpec):
    assert len(gpu.source) > 40, "source must name the datasheet/whitepaper/file"
    assert gpu.fp32_tflops > 0
    assert gpu.memory_gb > 0
    assert gpu.memory_bytes > 0
    assert gpu.memory_bandwidth_gbs > 0
    assert isinstance(gpu.sm_count, int) and gpu.sm_count > 0
    assert gpu.architecture in {"pascal", "volta", "turing", "ampere", "ada", "hopper", "blackwell"}
    assert gpu.sm_version >= 60
    # Dense tensor rates never undercut plain fp32, and fp8 never undercuts fp16.
    for rate in (gpu.tf32_tflops, gpu.fp16_tflops, gpu.bf16_tflops):
        assert rate is None or rate >= gpu.fp32_tflops
    if gpu.fp8_tflops and gpu.fp16_tflops:
        assert gpu.fp8_tflops >= gpu.fp16_tflops
    # Ampere and newer all have bf16 tensor cores except where no source was found (A10G).
    if gpu.sm_version >= 80 and gpu.id != "a10g":
        assert gpu.bf16_tflops and gpu.tf32_tflops


def test_memory_bytes_convention():
    for g in all_gpus():
        if g.id == "rtx-3060":
            # exact total recorded by the xMem runs in shared/data/memory
            assert g.memory_bytes == 12622168064
        else:
            assert g.memory_bytes == int(g.memory_gb * GIB), g.id


def test_known_values_spot_check():
    h100 = get_gpu("h100-sxm")
    assert (h100.sm_count, h100.bf16_tflops, h100.memory_bandwidth_gbs) == (132, 989.4, 3350)
    assert h100.compute_capability == "9.0"
    a100 = get_gpu("a100-40gb-sxm")
    assert (a100.sm_count, a100.tf32_tflops, a100.l2_cache_mb, a100.tdp_w) == (108, 156, 40, 400)
    assert get_gpu("l4").sm_count == 58
    assert get_gpu("rtx-5090").compute_capability == "12.0"


def test_base_clocks_sourced_and_below_boost():
    # Epoch AI CSV (L4, T4), TechPowerUp (A100 PCIe 40 GB); none found for A100 PCIe 80 GB.
    assert [get_gpu(g).base_clock_mhz for g in ("l4", "t4", "a100-40gb-pcie")] == [795, 585, 765]
    assert get_gpu("a100-80gb-pcie").base_clock_mhz is None
    for g in all_gpus():
        if g.base_clock_mhz is not None:
            assert g.boost_clock_mhz and 0 < g.base_clock_mhz <= g.boost_clock_mhz, g.id
            assert "base clock" in g.source, g.id


# ----------------------------------------------------------------------------- prices


def test_prices_joined_from_lowest_observed():
    assert get_gpu("h100-sxm").price_usd_per_hour == pytest.approx(3.99)
    assert get_gpu("t4").price_usd_per_hour == pytest.approx(0.526)
    assert get_gpu("a100-80gb-pcie").price_usd_per_hour == pytest.approx(1.39)
    priced = [g for g in all_gpus() if g.price_usd_per_hour is not None]
    assert len(priced) >= 10
    for g in priced:
        assert g.price_usd_per_hour > 0
        assert "skypilot-org/skypilot-catalog" in g.price_source
        assert re.search(r"@[0-9a-f]{40}", g.price_source), "price source must pin a commit"
    assert get_gpu("rtx-4090").price_usd_per_hour is None


# ----------------------------------------------------------------------------- name resolution


@pytest.mark.parametrize("gpu_id", REQUIRED_IDS)
def test_ids_resolve_to_themselves(gpu_id: str):
    assert resolve_gpu_id(gpu_id) == gpu_id
    assert resolve_gpu_id(gpu_id.upper()) == gpu_id
    assert get_gpu(gpu_id).id == gpu_id


@pytest.mark.parametrize(("name", "expected"), sorted(DEVICE_NAMES.items()))
def test_device_names_resolve(name: str, expected: str):
    assert resolve_gpu_id(name) == expected


def test_every_listed_alias_and_name_resolves_to_its_row():
    for g in all_gpus():
        assert resolve_gpu_id(g.name) == g.id
        for alias in gpu_aliases(g.id):
            assert resolve_gpu_id(alias) == g.id, alias


def test_neusight_device_folders_resolve_when_data_present():
    from data_collection.paths import shared_data_dir

    folder = shared_data_dir() / "neusight" / "device_configs"
    assert folder.is_dir(), folder
    for f in folder.glob("*.json"):
        if f.stem.startswith("AMD") or f.stem.endswith("_TP"):
            continue  # AMD parts are not in the table; _TP is a 2-GPU pseudo-device
        resolve_gpu_id(f.stem)


def test_unknown_gpu_suggests_close_match():
    with pytest.raises(UnknownGpuError, match=r"unknown GPU 'h100-sxn' \(did you mean: .*h100-sxm"):
        get_gpu("h100-sxn")
    with pytest.raises(UnknownGpuError, match=r"h100-pcie"):
        resolve_gpu_id("h100")  # ambiguous prefix lists every H100
    # a typo after a known prefix: the ids that prefix starts first (difflib had offered
    # a10, a10g, h100-sxm for a100x)
    a100s = sorted(g.id for g in all_gpus() if g.id.startswith("a100"))
    with pytest.raises(UnknownGpuError) as err:
        resolve_gpu_id("a100x")
    assert str(err.value).startswith(f"unknown GPU 'a100x' (did you mean: {', '.join(a100s)}, ")
    with pytest.raises(UnknownGpuError) as err:
        resolve_gpu_id("totally-not-a-gpu-zzz")
    assert isinstance(err.value, BoomError)
    assert "python -m boom_ml.gpus" in str(err.value)


# ----------------------------------------------------------------------------- peak_flops


def test_peak_flops_picks_the_right_rate():
    a100 = get_gpu("a100-80gb-sxm")
    assert a100.peak_flops("float32") == pytest.approx(19.5e12)
    assert a100.peak_flops("float32", tf32=True) == pytest.approx(156e12)
    assert a100.peak_flops("torch.float16") == pytest.approx(312e12)
    assert a100.peak_flops("bfloat16") == pytest.approx(312e12)
    h100 = get_gpu("h100-sxm")
    assert h100.peak_flops("float8_e4m3fn") == pytest.approx(1978.9e12)
    v100 = get_gpu("v100-sxm2-16gb")
    assert v100.peak_flops("float32", tf32=True) == pytest.approx(15.7e12)  # no TF32 on Volta
    assert v100.peak_flops("float16") == pytest.approx(125e12)
    # no bf16 tensor cores before Ampere: the fp32 rate; an Ampere sheet silent on bf16
    # (the A10G's) keeps the fp16 rate, which Ampere's tensor cores run bf16 at
    assert v100.peak_flops("bfloat16") == pytest.approx(15.7e12)
    assert get_gpu("a10g").peak_flops("bfloat16") == pytest.approx(70e12)
    p4 = get_gpu("p4")
    assert p4.peak_flops("float16") == pytest.approx(5.5e12)  # no fast fp16: fp32 rate
    assert get_gpu("rtx-4090").peak_flops("float16") == pytest.approx(165.2e12)


# ----------------------------------------------------------------------------- lists


def test_parse_gpu_list_forms():
    everything = parse_gpu_list("all")
    assert [g.id for g in everything] == [g.id for g in all_gpus()]
    assert [g.id for g in parse_gpu_list("ALL")] == [g.id for g in all_gpus()]
    assert [g.id for g in parse_gpu_list("h100-sxm")] == ["h100-sxm"]
    assert [g.id for g in parse_gpu_list("l4, a100-40gb-sxm")] == ["l4", "a100-40gb-sxm"]
    assert [g.id for g in parse_gpu_list(("t4", "Tesla T4", "h200"))] == ["t4", "h200"]
    assert len(parse_gpu_list(["h100-sxm", "all"])) == len(all_gpus())
    assert parse_gpu_list([str(EXAMPLE_YAML), "l4"])[0].id == "hypothetical-x1"
    # gpu=4090 reaches here as Hydra's int: read as the alias it names, not refused as a
    # list it cannot read; a number that names none gets the did-you-mean of a typo
    assert [g.id for g in parse_gpu_list(4090)] == ["rtx-4090"]
    with pytest.raises(UnknownGpuError, match=r"unknown GPU '42' \(did you mean"):
        parse_gpu_list(42)
    with pytest.raises(BoomError, match=r"^gpu=true names no GPU"):
        parse_gpu_list(True)


def test_parse_gpu_list_accepts_hydra_listconfig():
    omegaconf = pytest.importorskip("omegaconf")
    cfg = omegaconf.OmegaConf.create({"gpus": ["a100-80gb-sxm", "h100-sxm", "l4"]})
    assert [g.id for g in parse_gpu_list(cfg.gpus)] == ["a100-80gb-sxm", "h100-sxm", "l4"]


@pytest.mark.parametrize("bad", [None, "", [], 42, {"gpu": "l4"}, False])
def test_parse_gpu_list_rejects_empty_or_odd_values(bad):
    with pytest.raises(BoomError):
        parse_gpu_list(bad)


def test_parse_gpu_list_unknown_member():
    with pytest.raises(UnknownGpuError, match="h100-sxn"):
        parse_gpu_list(["l4", "h100-sxn"])


# ----------------------------------------------------------------------------- CLI


def test_cli_prints_table_and_details(capsys):
    assert cli_main([]) == 0
    out = capsys.readouterr().out
    assert "h100-sxm" in out and "rtx-pro-6000-blackwell-max-q" in out
    # the A10G's sheet gives no bf16 rate; predictions run it at the fp16 rate (Ampere): the
    # table says so rather than "-", which read as no bf16 at all; the T4 has none
    a10g, t4 = (next(ln for ln in out.splitlines() if f" {g} " in ln) for g in ("a10g", "t4"))
    assert "70.0*" in a10g and "*" not in t4 and "bf16 *: no sheet figure" in out
    assert cli_main(["NVIDIA_L4", str(EXAMPLE_YAML)]) == 0
    out = capsys.readouterr().out
    assert "NeuSight" in out and "hypothetical-x1" in out
    assert cli_main(["h100-sxn"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: unknown GPU 'h100-sxn' (did you mean")
    assert err.count("\n") == 1  # one line on stderr, as boom_ml.predict's errors
    assert cli_main(["all"]) == 0 and "h100-sxm" in capsys.readouterr().out  # as gpu=all
    # every name checked before any table, each GPU once (a hunt: two tables of one L4, then
    # the error)
    assert cli_main(["L4", "NVIDIA L4", "nope"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: unknown GPU 'nope'")
    assert cli_main(["L4", "NVIDIA L4"]) == 0
    assert capsys.readouterr().out.count("NVIDIA L4 datasheet") == 1
