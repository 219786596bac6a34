"""A user's GPU YAML (boom_ml.gpus.load_user_gpu): loading, round trips, defaults filled in
(tensor rates, clock), and one-line errors for files that cannot be read; their numbers'
ranges and units: test_gpu_user_checks.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from boom_ml.errors import InvalidInputError
from boom_ml.gpus import all_gpus, get_gpu, load_user_gpu, parse_gpu_list
from boom_ml.gpus.spec import ARCHITECTURES, GIB

REPO = Path(__file__).resolve().parents[1]
EXAMPLE_YAML = REPO / "configs" / "gpus" / "example_unreleased.yaml"


def test_example_yaml_loads():
    spec = get_gpu(str(EXAMPLE_YAML))
    assert spec.id == "hypothetical-x1"
    assert "hypothetical" in spec.name.lower()
    assert spec.memory_bytes == 256 * GIB
    assert spec.peak_flops("bfloat16") == pytest.approx(2400e12)
    assert get_gpu(EXAMPLE_YAML) == spec  # Path objects work too


def test_yaml_round_trip(tmp_path: Path):
    original = get_gpu("h100-sxm")
    path = tmp_path / "copy.yaml"
    path.write_text(yaml.safe_dump(original.to_dict()))
    assert load_user_gpu(path) == original


def test_a_yaml_gpu_named_as_a_table_gpu_is_no_silent_swap(tmp_path: Path):
    """A copy of the table's H100 is the same GPU, listed once; a 24 GiB part calling itself
    h100-sxm beside the table's one is an error, not one row that drops either."""
    original = get_gpu("h100-sxm")
    copy, other = tmp_path / "copy.yaml", tmp_path / "small.yaml"
    copy.write_text(yaml.safe_dump(original.to_dict()))
    other.write_text(yaml.safe_dump({**original.to_dict(), "memory_gb": 24, "memory_bytes": None,
                                     "total_memory_bytes": None}))  # fmt: skip
    assert parse_gpu_list([str(copy), "h100-sxm"]) == [original]
    unsourced = tmp_path / "unsourced.yaml"  # the same numbers without the table's sources
    unsourced.write_text(yaml.safe_dump({**original.to_dict(), "source": ""}))
    assert parse_gpu_list([str(unsourced), "h100-sxm"])[0].id == "h100-sxm"
    with pytest.raises(InvalidInputError) as err:
        parse_gpu_list([str(other), "h100-sxm"])
    # the fields that differ, not two sources' whole text (700 characters)
    assert str(err.value).startswith(
        "two different GPUs are named 'h100-sxm' (memory_gb 24 and 80,"
    )
    assert len(str(err.value)) < 300


def test_yaml_minimal_fills_defaults(tmp_path: Path):
    path = tmp_path / "My Future GPU.yml"
    path.write_text(
        "name: Future\narchitecture: blackwell\ncompute_capability: 10.0\nsm_count: 10\n"
        "memory_gb: 8\nmemory_bandwidth_gbs: 100\nfp32_tflops: 1.5\n"
    )
    spec = get_gpu(str(path))
    assert spec.id == "my-future-gpu"
    assert spec.compute_capability == "10.0"
    assert spec.memory_bytes == 8 * GIB
    assert spec.l2_cache_mb is None and spec.fp16_tflops > spec.fp32_tflops  # Blackwell's
    assert spec.peak_flops("float16") == pytest.approx(spec.fp16_tflops * 1e12)
    assert str(path) in spec.source


def test_a_spec_without_a_clock_takes_the_one_its_fp32_rate_implies(tmp_path: Path):
    """An A100 given by SMs, bandwidth and fp32 rate alone: its tensor-core rates are the
    A100's (the fp32 rate implies its 1410 MHz), not those of Ampere's median clock."""
    a100 = get_gpu("a100-80gb-sxm")
    path = tmp_path / "a100_like.yaml"
    path.write_text(yaml.safe_dump({
        "name": "A100-like", "architecture": "ampere", "compute_capability": "8.0",
        "sm_count": a100.sm_count, "memory_gb": 80, "memory_bandwidth_gbs": 2039,
        "fp32_tflops": a100.fp32_tflops}))  # fmt: skip
    spec = get_gpu(str(path))
    assert spec.boost_clock_mhz is None
    assert (spec.tf32_tflops, spec.fp16_tflops, spec.bf16_tflops) == (
        a100.tf32_tflops, a100.fp16_tflops, a100.bf16_tflops)  # fmt: skip


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("name: X\narchitecture: ada\n", r"missing required .*compute_capability.*sm_count"),
        (
            "name: X\narchitecture: ada\ncompute_capability: '8.9'\nsm_count: 1\nmemory_gb: 1\n"
            "memory_bandwidth_gbs: 1\nfp32_tflops: 1\nfp16_tflop: 2\nwarp_size: 32\n",
            r"unknown GPU spec field\(s\): fp16_tflop, warp_size \(did you mean: fp16_tflops\?\)",
        ),
        ("- just\n- a list\n", r"expected a mapping"),
        ("", r"the file is empty \(a GPU spec is a mapping of fields\)"),  # was "got NoneType"
        # two misspelt keys: one parenthesis (two had followed each other)
        (
            "name: X\nfp61_tflops: 3\nmemory_bandwith_gbs: 4\n",
            r"fp61_tflops, memory_bandwith_gbs \(did you mean: fp16_tflops, memory_bandwidth_gbs\?\);",
        ),
        ("name: [unclosed\n", r"not valid YAML"),
        (
            "name: X\narchitecture: ada\ncompute_capability: '8.9'\nsm_count: lots\nmemory_gb: 1\n"
            "memory_bandwidth_gbs: 1\nfp32_tflops: 1\n",
            r"'sm_count' must be an integer",
        ),
        (
            "name: X\narchitecture: ada\ncompute_capability: '8.9'\nsm_count: 4\nmemory_gb: 0\n"
            "memory_bandwidth_gbs: 1\nfp32_tflops: 1\n",
            r"'memory_gb' must be positive",
        ),
        (
            "name: X\narchitecture: ada\ncompute_capability: sm89\nsm_count: 4\nmemory_gb: 1\n"
            "memory_bandwidth_gbs: 1\nfp32_tflops: 1\n",
            r"compute_capability must look like",
        ),
    ],
)
def test_bad_yaml_errors(tmp_path: Path, text: str, message: str):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(InvalidInputError, match=message):
        get_gpu(str(path))


REQUIRED_BUT_ARCH = "sm_count: 4\nmemory_gb: 1\nmemory_bandwidth_gbs: 100\nfp32_tflops: 1\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "name: X\narchitecture: [hopper\nsm_count: 3\n",
            "not valid YAML (line 3, column 9: expected ',' or ']', but got ':')",
        ),
        (
            "name: X\n\tarchitecture: ada\n",
            "not valid YAML (line 2, column 1: found character '\\t' that cannot start any token)",
        ),
        (
            "name: X\narchitecture: ada\ncompute_capability: '8.9'\nsm_count: 4\n"
            "memory_gb: .inf\nmemory_bandwidth_gbs: 1\nfp32_tflops: 1\n",
            "field 'memory_gb' must be a finite number, got inf",
        ),
        (
            "name: X\narchitecture: hoper\ncompute_capability: '9.0'\n" + REQUIRED_BUT_ARCH,
            "unknown architecture 'hoper' (did you mean: hopper?); choose one of: pascal, volta, "
            "turing, ampere, ada, hopper, blackwell",
        ),
        (
            "name: X\narchitecture: hopper\ncompute_capability: '8.0'\n" + REQUIRED_BUT_ARCH,
            "compute_capability 8.0 does not match architecture hopper (9.0); known: pascal "
            "6.0-6.2, volta 7.0-7.2, turing 7.5, ampere 8.0-8.7, ada 8.9, hopper 9.0, "
            "blackwell 10.0-12.1",
        ),
    ],
)
def test_malformed_yaml_is_one_line_naming_the_file(tmp_path: Path, text: str, message: str):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(InvalidInputError) as err:
        get_gpu(str(path))
    assert str(err.value) == f"{path}: {message}"


def test_binary_yaml_is_one_line(tmp_path: Path):
    path = tmp_path / "bad.yaml"
    path.write_bytes(b"\xff\xfe\x00bin")
    with pytest.raises(InvalidInputError) as err:
        get_gpu(str(path))
    assert str(err.value) == f"{path}: not a UTF-8 text file"


def test_yaml_architecture_is_case_insensitive(tmp_path: Path):
    path = tmp_path / "gpu.yaml"
    path.write_text(
        "name: X\narchitecture: Hopper\ncompute_capability: '9.0'\n" + REQUIRED_BUT_ARCH
    )
    assert get_gpu(str(path)).architecture == "hopper"


def test_packaged_architectures_and_capabilities_are_known():
    for gpu in all_gpus():
        lo, hi = ARCHITECTURES[gpu.architecture]
        assert lo <= gpu.sm_version <= hi, gpu.id


def test_missing_yaml_file(tmp_path: Path):
    with pytest.raises(InvalidInputError, match="not found"):
        get_gpu(str(tmp_path / "nope.yaml"))


def test_a_yaml_gpu_named_as_a_table_gpu_shows_no_aliases_of_it(tmp_path: Path, capsys):
    """A spec may take a table GPU's id (a what-if copy: it is not that GPU); an A100-like spec
    named l4 had been listed with the L4's aliases (a hunt). Beside the L4 in one list it is
    refused; the table's own spec copied is the L4, aliases and all."""
    from boom_ml.gpus.__main__ import main as cli_main

    clash = tmp_path / "clash.yaml"
    clash.write_text(yaml.safe_dump({**get_gpu("a100-80gb-sxm").to_dict(), "id": "l4",
                                     "name": "My GPU"}))  # fmt: skip
    assert cli_main([str(clash)]) == 0
    assert "aliases" not in capsys.readouterr().out
    with pytest.raises(InvalidInputError, match="two different GPUs are named 'l4'"):
        parse_gpu_list([str(clash), "l4"])
    copy = tmp_path / "copy.yaml"
    copy.write_text(yaml.safe_dump(get_gpu("l4").to_dict()))
    assert cli_main([str(copy)]) == 0
    assert "NVIDIA L4" in next(ln for ln in capsys.readouterr().out.splitlines() if "aliases" in ln)


@pytest.mark.parametrize("bad", ["My GPU/x", "../up", "-dash", "a\\b"])
def test_a_yaml_gpu_id_that_cannot_name_a_file_is_refused(tmp_path: Path, bad: str):
    """The id names the figures plot= writes: 'My GPU/x' had crashed the run after writing one
    figure into a stray folder."""
    path = tmp_path / "odd.yaml"
    path.write_text(yaml.safe_dump({**get_gpu("a100-80gb-sxm").to_dict(), "id": bad}))
    with pytest.raises(InvalidInputError) as err:
        get_gpu(str(path))
    assert str(err.value) == (
        f"{path}: id {bad!r} must be letters, digits, spaces and . _ + - ( ), starting with a"
        " letter or digit"
    )


def test_figure_names_keep_a_python_gpus_id_inside_the_directory(tmp_path: Path):
    """A GpuSpec built in Python is not checked as a YAML one is: its id's separators become
    '_' in the file names, which stay in the plot directory."""
    from dataclasses import replace

    from boom_ml import api

    gpu = replace(get_gpu("l4"), id="My GPU/x")
    p = api.predict("torchvision:resnet18", gpu=gpu, batch_size=2, max_batch="off",
                    advice=False, plot=str(tmp_path / "figs"))  # fmt: skip
    names = sorted(path.name for path in (tmp_path / "figs").iterdir())
    assert names == ["torchvision_resnet18_memory_My GPU_x.png",
                     "torchvision_resnet18_time_My GPU_x.png"]  # fmt: skip
    assert sorted(Path(f).name for f in p.plots) == names
