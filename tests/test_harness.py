"""Collection harnesses end to end on the CPU (``device=cpu`` dry runs, tiny sizes).

Every row here is measured on the CPU and marked ``device_kind="cpu"``; the tests check
the pipeline (configs -> measurements -> validated shards -> resume -> fan-out), never
the numbers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch

from data_collection import kernels, schema, step_runner, steps
from data_collection.paths import shared_data_dir
from data_collection.shards import KEY, SimulatedCrash, read_shards, shard_files

REPO = Path(__file__).resolve().parent.parent
SWEEPS = REPO / "data_collection" / "sweeps"
SHARED = shared_data_dir()


def _runner() -> Any:
    """data_collection/sweeps/run_gpu_sweep.py (a script, not a package module)."""
    spec = importlib.util.spec_from_file_location("run_gpu_sweep", SWEEPS / "run_gpu_sweep.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RUNNER = _runner()
# One tiny shape per registered op: 4 for every param is valid for all of them.
ALL_OPS = [{"ops": [op], "shapes": [[4] * len(d.params)]} for op, d in kernels.REGISTRY.items()]
TINY_MODELS = [
    {"name": "torchvision:resnet18", "batch_sizes": [2], "image_size": 32},
    {"name": "hf:gpt2", "options": {"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 128},
     "batch_sizes": [2], "seq_len": 16},
]  # fmt: skip


def kernel_cfg(out: Path, **over: Any) -> dict[str, Any]:
    base = RUNNER.load_config(REPO / "configs" / "collect" / "kernels.yaml")
    return RUNNER.merge(base, {"out": str(out), "device": "cpu", "dry_run": True, **over})


def step_cfg(out: Path, **over: Any) -> dict[str, Any]:
    base = RUNNER.load_config(REPO / "configs" / "collect" / "steps.yaml")
    return RUNNER.merge(base, {"out": str(out), "device": "cpu", "dry_run": True,
                               "dry_run_configs": "all", "models": TINY_MODELS, **over})  # fmt: skip


def test_kernel_harness_every_op_on_cpu(tmp_path: Path) -> None:
    cfg = kernel_cfg(tmp_path, groups=ALL_OPS, dtypes=["float32", "bfloat16", "tf32"])
    kernels.run_kernel_sweep(cfg)
    df = read_shards(tmp_path, "kernels")
    schema.validate(df, "kernels", "test")
    assert set(df["op"]) == {d.row_op or op for op, d in kernels.REGISTRY.items()}
    assert set(df["device_kind"]) == {"cpu"} and set(df["gpu_id"]) == {"cpu"}
    assert set(df["direction"]) == {"forward", "backward"}
    assert (df["latency_ms"] > 0).all() and (df["n_repeats"] == 3).all()
    # No TF32 rows on a CPU (they would be fp32); never a backward row for a cast.
    assert "tf32" not in set(df["dtype"])
    assert not ((df["family"] == "copy") & (df["direction"] == "backward")).any()
    mm = df[(df["op"] == "mm")].iloc[0]
    assert (mm["b"], mm["m"], mm["n"], mm["k"]) == (1, 4, 4, 4)
    # conv2d_grouped's rows are conv2d rows with their groups (4 of 4 channels: depthwise)
    convs = df[df["op"] == "conv2d"]
    assert sorted(convs["groups"].fillna(1).unique()) == [1, 4]


def test_grouped_convolution_sweep_refuses_groups_that_do_not_divide(tmp_path: Path) -> None:
    from boom_ml.errors import InvalidInputError

    bad = [{"ops": ["conv2d_grouped"], "shapes": [[8, 96, 96, 3, 56, 56, 1, 1, 64]]}]
    cfg = kernel_cfg(tmp_path, groups=bad, dry_run=False)
    with pytest.raises(
        InvalidInputError, match=r"conv2d_grouped: shape \[8, 96, 96, 3, 56, 56, 1, 1, 64\]: groups"
    ):
        kernels.expand(cfg, "cpu", on_cuda=False)


def test_a_dry_run_keeps_a_grouped_convolution_grouped(tmp_path: Path) -> None:
    """Capping every size at 16 had made ResNeXt's 32 groups of 8 channels depthwise (and a
    duplicate), and a valid 48-channel, 12-group shape unrunnable (16 % 12): a dry run keeps at
    most 4 groups of at most 4 channels each (a helper's hunt)."""
    shapes = [[32, 256, 256, 3, 28, 28, 1, 1, 32], [8, 144, 144, 3, 56, 56, 1, 1, 144],
              [8, 48, 48, 3, 16, 16, 1, 1, 12], [8, 20, 40, 3, 16, 16, 1, 1, 20]]  # fmt: skip
    cfg = kernel_cfg(tmp_path, groups=[{"ops": ["conv2d_grouped"], "shapes": shapes}],
                     dtypes=["float32"], directions=["forward"])  # fmt: skip
    got = [(c["params"]["in_channels"], c["params"]["out_channels"], c["params"]["groups"])
           for _, c in kernels.expand(cfg, "cpu", on_cuda=False)]  # fmt: skip
    assert got == [(16, 16, 4), (4, 4, 4), (16, 16, 4), (4, 8, 4)]


def test_kernel_sweep_killed_midway_resumes(tmp_path: Path) -> None:
    cfg = kernel_cfg(tmp_path, only_ops=["mm", "add", "layer_norm"], dtypes=["float32"],
                     flush_every=2)  # fmt: skip
    expected = {k for k, _ in kernels.expand(cfg, "cpu", on_cuda=False)}
    with pytest.raises(SimulatedCrash):
        kernels.run_kernel_sweep({**cfg, "fail_after": 5})
    assert len(read_shards(tmp_path, "kernels")) == 4  # flushed before the kill
    kernels.run_kernel_sweep(cfg)
    keys = read_shards(tmp_path, "kernels", keep_extra=True)[KEY]
    assert keys.is_unique and set(keys) == expected


def test_step_harness_on_cpu_with_op_profiles_and_resume(tmp_path: Path) -> None:
    cfg = step_cfg(tmp_path, amp=["bf16"], checkpointing=["none", "full"], flush_every=1)
    expected = {k for k, _ in step_runner.expand(cfg, "cpu", on_cuda=False)}
    assert len(expected) == 4
    with pytest.raises(SimulatedCrash):  # killed after the 2nd config, before its flush
        steps.run_step_sweep({**cfg, "fail_after": 2})
    assert len(read_shards(tmp_path, "steps")) == 1
    steps.run_step_sweep(cfg)

    rows = read_shards(tmp_path, "steps", keep_extra=True)
    assert rows[KEY].is_unique and set(rows[KEY]) == expected
    df = schema.validate(rows[schema.columns("steps")], "steps", "test")
    assert set(df["device_kind"]) == {"cpu"} and not df["oom"].any()
    assert (df["step_time_ms"] > 0).all() and set(df["checkpointing"]) == {"none", "full"}
    assert set(df["model_family"]) == {"cnn", "transformer"}
    assert df["peak_allocated_bytes"].isna().all()  # CUDA counters: nothing invented on CPU

    prof = read_shards(tmp_path, "op_profiles", keep_extra=True)
    schema.validate(prof[schema.columns("op_profiles")], "op_profiles", "test")
    assert set(prof["step_key"]) == expected  # one profile per config, never duplicated
    assert not prof.duplicated(["step_key", "node_index"]).any()
    assert {"forward", "backward", "optimizer"} <= set(prof["phase"])
    assert "recompute" in set(prof["phase"])  # checkpointing's re-run forward is mapped
    assert (prof["duration_ms"] >= 0).all()


def test_step_dry_run_is_a_handful_of_configs_covering_every_option() -> None:
    cfg = RUNNER.merge(RUNNER.load_config(REPO / "configs" / "collect" / "steps.yaml"),
                       {"device": "cpu", "dry_run": True})  # fmt: skip
    plan = [c for _, c in step_runner.expand(cfg, "cpu", on_cuda=False)]
    assert [c["model"] for c in plan] == [m["name"] for m in cfg["models"]]  # one per model
    assert [(c["amp"], c["checkpointing"]) for c in plan] == [
        ("none", "none"), ("none", "full"), ("fp16", "none"), ("fp16", "full"), ("bf16", "none")
    ]  # fmt: skip
    assert all(c["profile"] and c["batch_size"] == 2 for c in plan)
    assert all(c["seq_len"] == 32 for c in plan if c["model"].startswith("hf:"))
    assert all(c["options"]["hidden_size"] == 64 for c in plan if c["model"].startswith("hf:"))
    vit = next(c for c in plan if c["model"] == "torchvision:vit_b_16")
    assert vit["image_size"] == vit["options"]["image_size"] == 32
    full = step_runner.expand({**cfg, "dry_run_configs": "all"}, "cpu", on_cuda=False)
    assert len(full) == 30  # 5 models x 3 amp x 2 checkpointing


def test_oom_is_a_data_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def out_of_memory(self: step_runner.StepRunner) -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(step_runner.StepRunner, "__call__", out_of_memory)
    steps.run_step_sweep(step_cfg(tmp_path, models=TINY_MODELS[:1], amp=["none"],
                                  checkpointing=["none"]))  # fmt: skip
    df = read_shards(tmp_path, "steps")
    assert len(df) == 1 and bool(df["oom"].iloc[0]) and pd.isna(df["step_time_ms"].iloc[0])
    assert "oom during warm-up" in df["notes"].iloc[0]
    assert read_shards(tmp_path, "op_profiles").empty


def test_gpu_sweep_files_load_and_runner_dry_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kcfg = RUNNER.load_config(SWEEPS / "h200_kernels.yaml")
    scfg = RUNNER.load_config(SWEEPS / "h200_steps.yaml")
    assert kcfg["time_budget_min"] and scfg["time_budget_min"]  # the < 8 min guard
    assert len(kernels.expand(kcfg, "h200", on_cuda=True)) > 100
    plan = [c for _, c in step_runner.expand(scfg, "h200")]
    assert {c["amp"] for c in plan} >= {"fp16", "bf16"} and not any(c["profile"] for c in plan)
    assert {c["checkpointing"] for c in plan} == {"none", "full"}
    # The runner end to end on tiny sweeps of the same shape (its own YAMLs, on the CPU).
    (tmp_path / "k.yaml").write_text(
        "defaults: [collect/kernels, _self_]\ndirections: [forward]\n"
        "groups: [{ops: [mm], shapes: [[4, 4, 4]]}]\n"
    )
    (tmp_path / "s.yaml").write_text(
        "defaults: [collect/steps, _self_]\namp: [fp16]\ncheckpointing: [none]\n"
        "models: [{name: 'hf:gpt2', options: {n_layer: 1, n_embd: 32, n_head: 2, vocab_size: 128},"
        " batch_sizes: [2], seq_len: 16}]\n"
    )
    out = tmp_path / "out"
    # Steps first, then kernels: the plan's order is the order they run in.
    argv = [str(out), "--device", "cpu", "--dry-run", "--sweep", f"steps={tmp_path / 's.yaml'}",
            "--sweep", f"kernels={tmp_path / 'k.yaml'}", "--budget-min", "5", "--margin-min", "0"]  # fmt: skip
    assert RUNNER.main(argv) == 0
    assert sorted(read_shards(out, "kernels")["dtype"]) == ["bfloat16", "float16", "float32"]
    assert read_shards(out, "steps")["amp"].tolist() == ["fp16"]
    printed = capsys.readouterr().out
    assert printed.index("steps sweep s.yaml") < printed.index("kernels sweep k.yaml")
    record = json.loads((out / "environment.json").read_text())  # what the SOURCE.md needs
    assert record["device"] == "cpu" and record["torch_version"] == torch.__version__
    assert record["transformers_version"] and record["date_utc"].endswith("Z")
    with pytest.raises(SystemExit, match="expected kernels=FILE"):
        RUNNER.parse_plan(["optimizer=x.yaml"])


def test_runner_stops_on_missing_inputs_and_fails_when_a_sweep_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A plan naming uncarried .sweep_inputs stops before measuring anything; a sweep that
    raises makes the run exit 1, not 0 (the lease reports the run's exit status)."""
    (tmp_path / "s.yaml").write_text(
        "defaults: [collect/steps, _self_]\n"
        "models: [{name: 'hf:.sweep_inputs/none/absent.json', batch_sizes: [1], seq_len: 8}]\n"
    )
    with pytest.raises(SystemExit, match=r"missing sweep inputs \(1\), e.g. s.yaml: "):
        RUNNER.main([str(tmp_path / "out"), "--sweep", f"steps={tmp_path / 's.yaml'}"])
    (tmp_path / "k.yaml").write_text(
        "defaults: [collect/kernels, _self_]\ngroups: [{ops: [mm], shapes: [[4, 4, 4]]}]\n"
    )
    argv = [str(tmp_path / "k_out"), "--device", "cpu", "--dry-run",
            "--sweep", f"kernels={tmp_path / 'k.yaml'}"]  # fmt: skip

    assert RUNNER.main(argv) == 0  # measured its rows
    assert RUNNER.main(argv) == 1  # resumed: nothing left to measure, nothing measured
    assert '"measured_now": 0' in capsys.readouterr().out

    def broken(cfg: dict) -> None:
        raise RuntimeError("a sweep that breaks")

    monkeypatch.setattr(kernels, "run_kernel_sweep", broken)
    argv[0] = str(tmp_path / "fresh")
    assert RUNNER.main(argv) == 1
    assert '"failed": ["kernels=k.yaml"]' in capsys.readouterr().out


def test_neusight_sweeps_match_the_labels_they_stand_for() -> None:
    """The H200 NeuSight sweeps: the ten A100-80GB train labels' configs, fp32 eager, no optimizer."""
    scfg = RUNNER.load_config(SWEEPS / "h200_neusight_steps.yaml")
    plan = [c for _, c in step_runner.expand(scfg, "h200")]
    got = sorted((Path(c["model"][3:]).stem, c["seq_len"], c["batch_size"]) for c in plan)
    index = pd.read_csv(SHARED / "neusight" / "labels_index.csv")
    a100 = index[(index.gpu_folder == "NVIDIA_A100_80GB_PCIe") & (index["mode"] == "train")]
    assert got == sorted(zip(a100.model, a100.seq_len, a100.batch_size, strict=True))
    assert {(c["amp"], c["optimizer"], c["tf32"], c["options"]["attn_implementation"])
            for c in plan} == {("none", "none", False, "eager")}  # fmt: skip
    kcfg = RUNNER.load_config(SWEEPS / "h200_neusight_kernels.yaml")
    rows = kernels.expand(kcfg, "h200", on_cuda=True)
    assert len(rows) == 400 and {c["dtype"] for _, c in rows} == {"float32"}


def test_two_job_multirun_through_submitit_local(tmp_path: Path) -> None:
    out, sweep = tmp_path / "shards", tmp_path / "hydra"
    cmd = [sys.executable, "-m", "data_collection.kernels", "-m", "device=cpu", "dry_run=true",
           f"out={out}", "dtypes=[float32]", "only_ops=[mm,add,layer_norm,softmax]",
           "num_shards=2", "shard_index=0,1", "hydra/launcher=submitit_local",
           f"hydra.sweep.dir={sweep}"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "BOOM_HYDRA_DIR": str(tmp_path)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = [Path(f).name for f in shard_files(out, "kernels")]
    assert any("-s0of2-" in f for f in files) and any("-s1of2-" in f for f in files)
    keys = read_shards(out, "kernels", keep_extra=True)[KEY]
    cfg = kernel_cfg(out, dtypes=["float32"], only_ops=["mm", "add", "layer_norm", "softmax"])
    assert keys.is_unique and set(keys) == {k for k, _ in kernels.expand(cfg, "cpu", False)}


def test_nvml_delta_keeps_the_baseline_the_process_took_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where NVML hides process ids the reading is used memory minus a baseline: the one taken
    when the process first asked (before CUDA), not when each sweep starts (after an earlier
    sweep's context and workspaces, which it then left out). A fake NVML stands in."""
    from types import SimpleNamespace

    from data_collection import environment as env

    used = {"bytes": 100}
    fake = SimpleNamespace(
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: f"h{i}",
        nvmlDeviceGetHandleByUUID=lambda uuid: "h0",
        nvmlDeviceGetIndex=lambda handle: 0,
        nvmlDeviceGetMemoryInfo=lambda handle: SimpleNamespace(used=used["bytes"]),
        nvmlDeviceGetComputeRunningProcesses=lambda handle: [],  # process ids hidden
    )
    monkeypatch.setattr(env, "_nvml", lambda: fake)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: SimpleNamespace(uuid="u"))
    env.nvml_baseline.cache_clear()
    env.nvml_baseline()  # first thing in the process: 100 bytes used by others
    used["bytes"] = 600  # an earlier sweep's CUDA context and workspaces
    later = env.NvmlMemory(torch.device("cuda", 0))
    used["bytes"] = 900
    assert later.read() == 800 and later.method == "nvml-device-delta"
    env.nvml_baseline.cache_clear()


def test_dry_run_is_true_or_false() -> None:
    """A hunt: dry_run=maybe (or dry_run=no) ran a dry run with exit 0: any word was true."""
    from boom_ml.errors import InvalidInputError

    assert [kernels.dry_run(c) for c in ({"dry_run": True}, {"dry_run": False}, {})] == [
        True,
        False,
        False,
    ]
    with pytest.raises(InvalidInputError, match="^dry_run must be true or false, got 'no'$"):
        kernels.dry_run({"dry_run": "no"})
