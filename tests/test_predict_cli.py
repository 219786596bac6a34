"""`python -m boom_ml.predict`: the JSON contract and one-line errors with exit code 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from boom_ml.errors import (
    ArtifactError,
    BoomError,
    InvalidInputError,
    TraceError,
    UnknownGpuError,
    UnknownModelError,
)
from boom_ml.estimates import GpuPrediction, MemoryEstimate, Prediction, TimeEstimate
from boom_ml.predict import run, to_json

GIB = 1024**3
REPO = Path(__file__).resolve().parent.parent
BASE = {
    "model": "torchvision:resnet18",
    "gpu": "l4",
    "batch_size": 2,
    "seq_len": None,
    "image_size": 64,
    "optimizer": "adamw",
    "amp": "none",
    "checkpointing": "none",
    "tf32": False,
    "output": "json",
}

UNTRACEABLE = """
import torch
class DataDependent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
    def forward(self, x):
        n = int(self.lin(x).sum().item())  # a value, not a shape: fake tensors can't know it
        return self.lin(x)[:n]
    def example_inputs(self, batch_size, device):
        return {"x": torch.randn(batch_size, 8, device=device)}
def make():
    return DataDependent()
"""


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "boom_ml.predict", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )


def test_json_for_three_gpus():
    doc = json.loads(run({**BASE, "gpu": ["a100-80gb-sxm", "h100-sxm", "l4"]}))
    assert doc["model"] == "torchvision:resnet18" and doc["batch_size"] == 2
    assert doc["graph"]["num_ops"] > 100 and doc["graph"]["flops"] > 0
    assert [g["gpu"] for g in doc["gpus"]] == ["a100-80gb-sxm", "h100-sxm", "l4"]
    for g in doc["gpus"]:
        mem = g["memory"]
        assert g["fits"] is True
        assert 0 < mem["peak_allocated_bytes"] <= mem["peak_reserved_bytes"] <= mem["total_bytes"]
        assert mem["capacity_bytes"] > mem["total_bytes"]
        assert g["time"]["step_ms"] > 0 and g["time"]["method"]
    # a faster GPU is predicted faster
    times = {g["gpu"]: g["time"]["step_ms"] for g in doc["gpus"]}
    assert times["h100-sxm"] < times["l4"]


def test_table_output_lists_each_gpu():
    text = run({**BASE, "gpu": ["l4", "t4"], "output": "table"})
    assert "l4" in text and "t4" in text


@pytest.mark.parametrize(
    "change,error,words",
    [
        ({"model": "torchvision:resnet5O"}, UnknownModelError, "did you mean"),
        ({"gpu": "h100-sxn"}, UnknownGpuError, "h100-sxm"),
        ({"batch_size": 0}, InvalidInputError, "batch_size"),
        ({"seq_len": -3}, InvalidInputError, "seq_len"),
        ({"image_size": 0}, InvalidInputError, "image_size"),
        ({"optimizer": "adamx"}, InvalidInputError, "optimizer"),
        ({"amp": "fp8"}, InvalidInputError, "amp"),
        ({"checkpointing": "some"}, InvalidInputError, "checkpointing"),
        ({"output": "xml"}, InvalidInputError, "output"),
    ],
)
def test_bad_input_raises_user_error(change, error, words):
    with pytest.raises(error, match=words):
        run({**BASE, **change})


def test_a_user_error_met_while_tracing_is_not_wrapped_as_a_trace_failure():
    with pytest.raises(InvalidInputError) as err:
        run({**BASE, "model": "hf:gpt2", "seq_len": 2048, "image_size": None})
    assert str(err.value) == "hf:gpt2: seq_len 2048 exceeds its 1024 learned positions"


def test_untraceable_model_names_the_problem(tmp_path):
    path = tmp_path / "dd.py"
    path.write_text(UNTRACEABLE)
    with pytest.raises(TraceError, match="could not trace"):
        run({**BASE, "model": f"file:{path}:make", "image_size": None})


@pytest.mark.parametrize(
    "args",
    [
        ["model=torchvision:resnet5O"],
        ["gpu=h100-sxn"],
        ["batch_size=0"],
    ],
)
def test_cli_errors_are_one_line_exit_2(args):
    proc = cli(*args, "output=json")
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


SHAPE_BUG = """
import torch
class ShapeBug(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
    def forward(self, x):
        return self.lin(x) * torch.ones(3, device=x.device)  # (b, 8) * (3,): no broadcast
    def example_inputs(self, batch_size, device):
        return {"x": torch.randn(batch_size, 8, device=device)}
def make():
    return ShapeBug()
"""


def test_cli_shape_error_in_the_model_is_one_line(tmp_path):
    """A shape error inside the model's forward: torch's fake-tensor logger used to print
    its own 30-line traceback (``failed while attempting to run meta for aten.mul``) to
    stderr before boom-ml's one-line error."""
    path = tmp_path / "shape_bug.py"
    path.write_text(SHAPE_BUG)
    proc = cli(f"model=file:{path}:make", "gpu=l4", "batch_size=2", "max_batch=off")
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: could not trace"), proc.stderr
    assert "broadcast" in lines[0] or "size of tensor" in lines[0]


def test_cli_prints_valid_json():
    proc = cli(
        "model=torchvision:resnet18", "gpu=[l4,t4]", "batch_size=2", "image_size=32", "output=json"
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert {g["gpu"] for g in doc["gpus"]} == {"l4", "t4"}


def _prediction(step_ms: float, p10_ms: float, p90_ms: float, **memory) -> Prediction:
    """A hand-made one-GPU prediction (no trace) for the report's formatting."""
    mem = MemoryEstimate(GIB, GIB, GIB, 16 * GIB, True, "allocator-sim", **memory)
    time = TimeEstimate(step_ms, "per-op", p10_ms=p10_ms, p90_ms=p90_ms)
    step = {"optimizer": "adamw", "amp": "none", "checkpointing": "none"}
    return Prediction("m", 2, step, {}, [GpuPrediction("l4", "NVIDIA L4", mem, time)])


def _gpu_row(prediction: Prediction) -> list[str]:
    from rich.console import Console

    from boom_ml.report.table import gpu_table

    console = Console(width=200, force_terminal=False)
    with console.capture() as out:
        console.print(gpu_table(prediction))
    row = next(line for line in out.get().splitlines() if line.startswith("│ l4"))
    return [cell.strip() for cell in row.strip("│").split("│")]


def test_long_gpu_ids_are_printed_whole_in_a_narrow_table():
    from dataclasses import replace

    from boom_ml.report.table import render_table

    pred = _prediction(4403.94, 3490.04, 4965.26)
    pred.gpus[0] = replace(pred.gpus[0], gpu="rtx-pro-6000-blackwell-max-q")
    pred.graph.update(num_ops=1, flops=1e12, num_parameters=1e6, trace_seconds=0.1)
    text = render_table(pred)  # 130 columns, as the CLI renders it
    assert "│ rtx-pro-6000-blackwell-max-q │" in text


def test_sub_millisecond_time_range_keeps_the_central_values_precision():
    assert _gpu_row(_prediction(0.84, 0.62, 1.23))[3] == "0.8 (0.6–1.2)"
    assert _gpu_row(_prediction(4403.94, 3490.04, 4965.26))[3] == "4403.9 (3490.0–4965.3)"


def test_a_max_batch_of_zero_reads_none():
    assert _gpu_row(_prediction(1.0, 0.9, 1.1, max_batch_size=0))[6] == "none"
    assert _gpu_row(_prediction(1.0, 0.9, 1.1, max_batch_size=7))[6] == "7"


def test_a_step_that_does_not_fit_shows_no_rate_or_price():
    from dataclasses import replace

    from boom_ml.report.table import render_table

    ran = _prediction(500.0, 400.0, 600.0, fit="yes")
    ran.gpus[0] = replace(ran.gpus[0], price_usd_per_hour=0.72)
    # 2 samples / 0.5 s; $0.72 an hour for 500 s
    assert _gpu_row(ran)[4:6] == ["4.00", "0.100"]
    refused = _prediction(500.0, 400.0, 600.0, fit="no")
    refused.gpus[0] = replace(refused.gpus[0], price_usd_per_hour=0.72)
    assert _gpu_row(refused)[3:6] == ["500.0 (400.0–600.0)", "-", "-"]
    refused.graph.update(num_ops=1, flops=1e12, num_parameters=1e6, trace_seconds=0.1)
    assert "- where the step does not fit" in render_table(refused)
    assert "does not fit" not in render_table(replace(refused, gpus=ran.gpus))


TINY = """
import torch
class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
    def forward(self, x):
        return self.lin(x)
    def example_inputs(self, batch_size, device):
        return {"x": torch.randn(batch_size, 4, device=device)}
def make():
    return Tiny()
"""


def test_max_batch_at_the_search_cap_is_a_lower_bound(tmp_path):
    # 4x4 linear: 65536 samples are a few MiB, so the search stops at its cap still fitting
    options = {"model": _factory_file(tmp_path, TINY), "image_size": None, "gpu": "h100-sxm",
               "max_batch": "on", "advice": False}  # fmt: skip
    memory = json.loads(run({**BASE, **options}))["gpus"][0]["memory"]
    assert (memory["max_batch_size"], memory["max_batch_lower_bound"]) == (65536, True)
    assert json.loads(run(BASE))["gpus"][0]["memory"]["max_batch_lower_bound"] is False
    assert _gpu_row(_prediction(1.0, 0.9, 1.1, max_batch_size=65536))[6] == "65536"
    row = _gpu_row(_prediction(1.0, 0.9, 1.1, max_batch_size=65536, max_batch_lower_bound=True))
    assert row[6] == "≥ 65536"


def test_json_has_null_for_nan_and_infinity():
    prediction = _prediction(float("nan"), 0.5, float("inf"))
    prediction.graph = {"flops": float("-inf"), "shapes": (1.0, float("nan"))}
    text = to_json(prediction.to_dict())
    doc = json.loads(text, parse_constant=lambda name: pytest.fail(f"bare {name} in the JSON"))
    assert doc["gpus"][0]["time"]["step_ms"] is None
    assert (doc["gpus"][0]["time"]["p10_ms"], doc["gpus"][0]["time"]["p90_ms"]) == (0.5, None)
    assert doc["graph"] == {"flops": None, "shapes": [1.0, None]}


def test_every_error_is_a_boom_error():
    for cls in (UnknownModelError, UnknownGpuError, InvalidInputError, TraceError, ArtifactError):
        assert issubclass(cls, BoomError)  # what the CLI answers in one line, exit status 2


def _factory_file(tmp_path, body: str) -> str:
    path = tmp_path / "factory.py"
    path.write_text(body)
    return f"file:{path}:make"


@pytest.mark.parametrize(
    "body,words",
    [
        ("def make():\n    raise ValueError('no such layer')\n", "raised ValueError"),
        ("def make():\n    return 42\n", "Module"),
        (
            "import torch\ndef make():\n    return torch.nn.Sequential(torch.nn.LazyLinear(4))\n",
            r"lazy modules \(LazyLinear\) take their sizes from a first real forward",
        ),
    ],
)
def test_bad_file_factory(tmp_path, body, words):
    with pytest.raises(InvalidInputError, match=words):
        run({**BASE, "model": _factory_file(tmp_path, body)})


def test_malformed_hf_config(tmp_path):
    config = tmp_path / "config.json"
    config.write_text("{not json")
    with pytest.raises(InvalidInputError, match="config.json"):
        run({**BASE, "model": f"hf:{config}", "seq_len": 16, "image_size": None})


def test_max_batch_off_and_auto_over_many_gpus_skip_the_search():
    nine = ["l4", "t4", "a10g", "a100-80gb-sxm", "h100-sxm", "v100-sxm2-16gb", "rtx-4090",
            "a100-40gb-sxm", "rtx-3090"]  # fmt: skip
    for options in ({"gpu": ["l4", "t4"], "max_batch": "off"}, {"gpu": nine}):
        result = json.loads(run({**BASE, **options, "advice": False}))
        assert [g["memory"]["max_batch_size"] for g in result["gpus"]] == [None] * len(
            options["gpu"]
        )
    table = run({**BASE, "gpu": nine, "advice": False, "output": "table"})
    assert "max batch: not searched for 9 GPUs (max_batch=on searches each GPU" in table
    # max_batch=off asked for none: no line reads as if the GPU count had skipped it
    off = run({**BASE, "gpu": nine, "advice": False, "output": "table", "max_batch": "off"})
    assert "max batch:" not in off
    two = json.loads(run({**BASE, "gpu": ["l4", "t4"], "advice": False}))
    assert all(g["memory"]["max_batch_size"] >= 2 for g in two["gpus"])  # auto: searched


def test_unwritable_plot_directory(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(InvalidInputError, match="plot directory"):
        run({**BASE, "plot": str(blocker / "plots")})


def test_plots_are_written(tmp_path):
    run({**BASE, "gpu": ["l4", "t4"], "output": "table", "plot": str(tmp_path)})
    assert len(list(tmp_path.glob("*.png"))) == 3


def test_missing_per_op_model(tmp_path, monkeypatch):
    monkeypatch.setenv("BOOM_PER_OP_MODEL", str(tmp_path))
    with pytest.raises(ArtifactError, match="not found"):
        run(BASE)


def test_corrupt_per_op_model(tmp_path, monkeypatch):
    packaged = REPO / "boom_ml" / "artifacts" / "per_op"
    shutil.copytree(packaged, tmp_path / "per_op")
    for head in (tmp_path / "per_op").glob("*_p50.txt.gz"):
        head.write_bytes(b"this is not a gzip file")
    monkeypatch.setenv("BOOM_PER_OP_MODEL", str(tmp_path / "per_op"))
    with pytest.raises(ArtifactError, match="corrupt"):
        run(BASE)


def test_ctrl_c_ends_a_prediction_with_one_line_and_its_workers_with_it(tmp_path: Path) -> None:
    """SIGINT mid-way (after the first trace, while the advice's traces run in workers):
    exit status 130, "interrupted" and no traceback, no worker left behind."""
    import os
    import signal
    import time

    env = {**os.environ, "BOOM_CACHE_DIR": str(tmp_path), "BOOM_TRACE_WORKERS": "2"}
    argv = [sys.executable, "-m", "boom_ml.predict", "model=hf:meta-llama/Meta-Llama-3-8B",
            "gpu=all", "batch_size=4", "seq_len=2048", "amp=bf16"]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    traces = tmp_path / "traces"
    deadline = time.monotonic() + 300
    while not (traces.exists() and any(traces.iterdir())):  # the first trace is done
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
        time.sleep(0.2)
    running = subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True)
    assert len(running.stdout.split()) == 3  # the CLI and its two workers
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == "interrupted", err[-2000:]
    assert "Traceback" not in err
    time.sleep(1)
    left = subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True)
    assert left.stdout.strip() == ""  # the session it led holds no worker


def test_a_config_naming_hub_code_says_which_class_was_traced(tmp_path, monkeypatch):
    """A config.json with auto_map (trust_remote_code models) is built from transformers'
    own class for its model_type; the table and JSON say so, once."""
    from tiny_models import tiny_llama_config

    monkeypatch.setenv("BOOM_CACHE_DIR", str(tmp_path / "cache"))
    raw = {**tiny_llama_config(vocab_size=128),
           "auto_map": {"AutoConfig": "org/repo--configuration_x.XConfig",
                        "AutoModelForCausalLM": "modeling_x.XForCausalLM"}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(raw))
    options = {**BASE, "model": f"hf:{tmp_path / 'config.json'}", "seq_len": 16,
               "image_size": None, "advice": False}  # fmt: skip
    note = ("the config's auto_map names the repository's own code (configuration_x.XConfig, "
            "modeling_x.XForCausalLM); traced with transformers' LlamaForCausalLM instead "
            "(that code is never run here)")  # fmt: skip
    assert json.loads(run(options))["graph"]["model_notes"] == [note]
    assert run({**options, "output": "table"}).count(f"Note: {note}.") == 1
    (tmp_path / "config.json").write_text(json.dumps(tiny_llama_config(vocab_size=128)))
    assert json.loads(run(options))["graph"]["model_notes"] == []


def test_run_hands_nested_model_options_over_as_plain_python(tmp_path) -> None:
    """Hydra's DictConfig is a Mapping whose nested values stay DictConfig / ListConfig: run()
    converts the whole config, so a factory (or an hf config field such as rope_scaling) gets
    a list or dict, not an OmegaConf node."""
    from hydra import compose, initialize_config_dir

    from boom_ml.config_help import CONFIG_DIR
    from boom_ml.predict import run

    factory = tmp_path / "widths.py"
    factory.write_text(
        "import torch\n"
        "def make(widths=(8,)):\n"
        "    assert type(widths) is list, type(widths).__name__\n"
        "    return torch.nn.Sequential(torch.nn.Conv2d(3, widths[-1], 3),\n"
        "        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(widths[-1], 10))\n"
    )
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("predict", overrides=[
            f"model=file:{factory}:make", "gpu=l4", "batch_size=2", "image_size=32",
            "max_batch=off", "advice=false", "cache=off", "output=json",
            "model_options={widths:[4,8]}",
        ])  # fmt: skip
    assert json.loads(run(cfg))["graph"]["num_parameters"] == 8 * 3 * 9 + 8 + 8 * 10 + 10


def test_cudnn_settings_on_a_model_without_convolutions_are_said_unused(tmp_path):
    """tf32_cudnn and stack.cudnn_benchmark change only what cuDNN runs: on an MLP the table
    says they are not used (the header had named tf32_cudnn=false, without a word)."""
    mlp = _factory_file(tmp_path, TINY)  # a Linear: no convolution, nothing cuDNN runs
    options = {**BASE, "model": mlp, "image_size": None, "advice": False, "output": "table",
               "tf32_cudnn": False, "stack": {"cudnn_benchmark": True}}  # fmt: skip
    table = run(options)
    assert "Not used: tf32_cudnn=false, stack.cudnn_benchmark=true (cuDNN runs none of" in table
    assert "tf32_cudnn" not in run({**options, "model": "torchvision:resnet18",
                                   "image_size": 32, "stack": {}}).split("Not used")[-1]  # fmt: skip
