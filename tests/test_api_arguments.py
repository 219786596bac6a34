"""The Python API's arguments and results as a script meets them (an API hunt's findings)."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest

import boom_ml
from boom_ml.errors import InvalidInputError
from boom_ml.gpus import get_gpu
from boom_ml.plain_arguments import plain
from boom_ml.specs import StepSpec


def test_numpy_numbers_are_read_as_the_numbers_they_hold() -> None:
    """A sweep over a pandas column passes np.int64(8): it was refused as 'must be an integer
    >= 1, got np.int64(8)', np.bool_ as no boolean."""
    assert plain({"dp": np.int64(2), "x": [np.float32(0.5), (np.bool_(True),)]}) == {
        "dp": 2, "x": [0.5, (True,)]}  # fmt: skip
    assert type(plain(np.int64(8))) is int and type(plain(np.bool_(False))) is bool
    kw = dict(model="torchvision:resnet18", gpu="l4", image_size=32, max_batch="off")
    numpy = boom_ml.predict(**kw, batch_size=np.int64(2), advice=np.bool_(False),
                            finetune={"r": np.int64(8)})  # fmt: skip
    python = boom_ml.predict(**kw, batch_size=2, advice=False)
    one, other = numpy.to_dict(), python.to_dict()
    assert (one["step"], one["gpus"]) == (other["step"], other["gpus"])
    assert type(one["step"]["batch_size"]) is int and type(one["step"]["lora_r"]) is int


def test_a_layout_result_owns_its_numbers() -> None:
    """The per-rank memory terms came from the cached profile: a caller converting them to
    GiB changed what every later call in the process returned."""
    kw = dict(model="hf:gpt2", gpu=["l4"], batch_size=8, seq_len=128, max_batch="off",
              parallel={"dp": 2, "pp": 2}, advice=False)  # fmt: skip
    first = boom_ml.predict(**kw)
    kept = copy.deepcopy(first.to_dict())

    def scramble(node: object) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node)  # type: ignore[union-attr]
        for key, value in list(items):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                node[key] = -1  # type: ignore[index]
            elif isinstance(value, (dict, list)):
                scramble(value)

    for entry in first.parallel:
        scramble(entry)
    assert boom_ml.predict(**kw).to_dict() == kept


def test_a_gpu_spec_with_an_unknown_field_is_not_two_gpus() -> None:
    """NaN != NaN: a GpuSpec without a price was 'two different GPUs named' itself."""
    spec = dataclasses.replace(get_gpu("l4"), id="nan-l4", price_usd_per_hour=float("nan"))
    result = boom_ml.predict("torchvision:resnet18", gpu=[spec, spec], batch_size=2,
                             image_size=32, advice=False, max_batch="off")  # fmt: skip
    assert [g.gpu for g in result.gpus] == ["nan-l4"]
    other = dataclasses.replace(spec, memory_bytes=spec.memory_bytes // 2)
    with pytest.raises(InvalidInputError, match="two different GPUs are named 'nan-l4'"):
        boom_ml.predict("torchvision:resnet18", gpu=[spec, other], batch_size=2, image_size=32)


def test_a_factory_error_of_several_lines_is_one_line(tmp_path) -> None:
    path = tmp_path / "fac.py"
    path.write_text("def boom():\n    raise RuntimeError('factory exploded\\nsecond line')\n")
    with pytest.raises(InvalidInputError) as err:
        boom_ml.predict(f"file:{path}:boom", gpu="l4", image_size=32)
    assert "\n" not in str(err.value) and str(err.value).endswith("RuntimeError: second line")


def test_sys_exit_in_a_model_file_is_one_line(tmp_path) -> None:
    """A factory or a module body calling sys.exit(3) had ended the run with status 3 and
    not a word (SystemExit is no Exception)."""
    (tmp_path / "quits.py").write_text("import sys\ndef make():\n    sys.exit(3)\n")
    (tmp_path / "leaves.py").write_text("import sys\nsys.exit('bye')\n")
    with pytest.raises(InvalidInputError, match=r"quits\.py:make raised SystemExit: 3$"):
        boom_ml.predict(f"file:{tmp_path / 'quits.py'}:make", gpu="l4", image_size=32)
    with pytest.raises(InvalidInputError, match=r"leaves\.py raised SystemExit: bye$"):
        boom_ml.predict(f"file:{tmp_path / 'leaves.py'}:make", gpu="l4", image_size=32)


def test_a_misspelt_keyword_is_a_boom_error_with_a_suggestion() -> None:
    """It was Python's TypeError, which an ``except BoomError`` around predict missed."""
    with pytest.raises(InvalidInputError) as err:
        boom_ml.predict(model="hf:gpt2", gpu="l4", bacth_size=8)
    assert str(err.value).startswith(
        "predict() takes no argument 'bacth_size' (did you mean: batch_size"
    )
    # the step a Session evaluates, too (a hunt: it had been a bare TypeError)
    with pytest.raises(InvalidInputError) as err:
        boom_ml.StepSpec(bacth_size=8)
    assert str(err.value) == (
        "StepSpec() takes no argument 'bacth_size' (did you mean: batch_size, image_size?)"
    )


def test_an_unknown_model_or_gpu_is_an_invalid_input_as_the_readme_says() -> None:
    """The README: a bad keyword is an InvalidInputError "as every other bad input is"; an
    unknown model or GPU had been a BoomError beside it, which that except missed (a hunt)."""
    with pytest.raises(InvalidInputError, match="unknown GPU 'h100-sxn'"):
        boom_ml.predict("torchvision:resnet18", gpu="h100-sxn", image_size=32)
    with pytest.raises(InvalidInputError, match="nosuchmodel"):
        boom_ml.predict("torchvision:nosuchmodel", gpu="l4", image_size=32)


def test_session_takes_gpu_ids_and_reads_cache_words() -> None:
    """A hunt: Session.evaluate(step, ["l4"]) failed deep inside ('str' has no sm_version), and
    Session(model, cache="off") kept the on-disk cache on."""
    from boom_ml.specs import StepSpec

    step = StepSpec(batch_size=2, image_size=32)
    session = boom_ml.Session("torchvision:resnet18", cache="off")
    assert session._cache is None
    by_id = session.evaluate(step, ["l4", "t4", "l4"])
    by_spec = session.evaluate(step, [get_gpu("l4"), get_gpu("t4"), get_gpu("l4")])
    assert [g.gpu for g in by_id] == ["l4", "t4", "l4"]  # one result per item, in order
    assert [g.time.step_ms for g in by_id] == [g.time.step_ms for g in by_spec]
    with pytest.raises(InvalidInputError, match=r"^Session.evaluate takes a StepSpec .*str 'bad'"):
        session.evaluate("bad", ["l4"])  # replace()'s TypeError had said nothing of it
    # what predict's gpu= takes (a hunt: "all" and "l4,t4" were unknown GPUs, a Path or None
    # a TypeError); a stack as predict's mapping (an AttributeError)
    from pathlib import Path

    from boom_ml.gpus import all_gpus

    example = Path(boom_ml.__file__).parent.parent / "configs" / "gpus" / "example_unreleased.yaml"

    assert [g.gpu for g in session.evaluate(step, "l4,t4")] == ["l4", "t4"]
    assert [g.gpu for g in session.evaluate(step, example)] == ["hypothetical-x1"]
    assert len(session.evaluate(step, "all", max_batch=False)) == len(all_gpus())
    with pytest.raises(InvalidInputError, match="no GPU given"):
        session.evaluate(step, None)
    older = session.evaluate(step, "l4", stack={"torch": "2.4"})[0]
    assert older.time.step_ms > 0
    # the row's samples/s in its own JSON, as Prediction.to_dict has it
    assert by_id[0].to_dict()["samples_per_s"] == pytest.approx(by_id[0].samples_per_s)


def test_a_session_traces_what_predict_traced(tmp_path, monkeypatch) -> None:
    """Session(model) and predict() keyed the same step apart (predict's build options,
    sdpa attention and an even MoE, were filled in by it alone): each traced it again (a
    hunt). A StepSpec reads NumPy numbers as predict does."""
    monkeypatch.setenv("BOOM_CACHE_DIR", str(tmp_path))
    kw = {"batch_size": 2, "image_size": 32}
    first = boom_ml.predict("torchvision:resnet18", gpu="l4", max_batch="off", advice=False, **kw)
    assert first.graph["trace_from_cache"] is False
    step = StepSpec(batch_size=np.int64(2), image_size=np.int32(32))
    assert (type(step.batch_size), type(step.image_size)) == (int, int)
    session = boom_ml.Session("torchvision:resnet18")
    (again,) = session.evaluate(step, "l4")
    assert again.memory.total_bytes == first.gpus[0].memory.total_bytes
    assert all(graph.meta.get("from_cache") for graph in session._graphs.values())  # predict's


def test_to_dict_holds_plain_str_keys() -> None:
    """numpy's str_ keys (the peak's categories by module, temporaries by phase) broke
    yaml.safe_dump of to_dict(); json.dumps took them as the str subclass they are."""
    out = boom_ml.predict(model="torchvision:resnet18", gpu="l4", batch_size=2, image_size=32,
                          advice=False, max_batch="off").to_dict()  # fmt: skip

    def keys(value):
        if isinstance(value, dict):
            for k, v in value.items():
                yield k
                yield from keys(v)
        elif isinstance(value, list):
            for v in value:
                yield from keys(v)

    found = list(keys(out))
    assert found and all(type(k) is str for k in found)


def test_the_callable_module_shows_the_apis_keywords_and_points_cli_keys_elsewhere() -> None:
    """help(boom_ml.predict) showed (*args, **kwargs) and the CLI module's words, and
    predict(output="json") said only that it takes no such argument (a hunt)."""
    import inspect

    params = inspect.signature(boom_ml.predict).parameters
    assert list(params)[:3] == ["model", "gpu", "batch_size"] and "finetune" in params
    assert "boom_ml.api.predict" in boom_ml.predict.__doc__
    with pytest.raises(InvalidInputError, match=r"'output' \(the result is a Prediction; result"):
        boom_ml.predict("torchvision:resnet18", gpu="l4", output="json")
    with pytest.raises(InvalidInputError, match=r"'explain' \(.*render_table\(result, explain"):
        boom_ml.predict("torchvision:resnet18", gpu="l4", explain=True)


def test_a_session_keeps_transformers_quiet_as_predict_does(monkeypatch) -> None:
    """Session("hf:gpt2").evaluate printed transformers' loss_type warning, which
    boom_ml.predict keeps off the terminal (a hunt). Its level inside evaluate is asked
    (the warning itself is printed once per process, by whichever test builds gpt2 first)."""
    import logging

    from boom_ml import session as session_module
    from boom_ml.specs import StepSpec

    levels = []
    estimate = session_module.estimate_memory

    def spy(*args, **kwargs):
        from transformers.utils import logging as hf_logging

        levels.append(hf_logging.get_verbosity())
        return estimate(*args, **kwargs)

    monkeypatch.setattr(session_module, "estimate_memory", spy)
    monkeypatch.delenv("TRANSFORMERS_VERBOSITY", raising=False)
    boom_ml.Session("hf:gpt2", cache="off").evaluate(StepSpec(batch_size=1, seq_len=32), ["l4"])
    assert levels == [logging.ERROR]


def test_what_a_model_prints_stays_off_the_cli_output(tmp_path, capsys) -> None:
    """A forward that prints had put its lines before the JSON document on stdout (a hunt):
    the CLI's stdout holds the document alone, and the prints go to stderr."""
    import json

    from boom_ml.predict import run

    path = tmp_path / "printing.py"
    path.write_text(
        "import torch\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = torch.nn.Linear(3 * 8 * 8, 4)\n"
        "    def forward(self, x):\n"
        "        print('hello from forward')\n"
        "        return self.fc(x.flatten(1))\n"
        "def make():\n"
        "    return Net()\n"
    )
    out = run({"model": f"file:{path}:make", "image_size": 8, "gpu": "l4", "batch_size": 2,
               "output": "json", "cache": False, "advice": False, "max_batch": "off"})  # fmt: skip
    captured = capsys.readouterr()
    assert json.loads(out)["batch_size"] == 2
    assert "hello from forward" not in captured.out and "hello from forward" in captured.err


def test_a_failure_in_the_users_loss_says_so(tmp_path) -> None:
    """An error raised in a file's loss(outputs, inputs) read as if the model had failed, with
    a hint about synthesised inputs, and a loss that is not a scalar met autograd's "grad can
    be implicitly created only for scalar outputs" (a hunt)."""
    from boom_ml.errors import TraceError

    model = ("import torch\n"
             "class Net(torch.nn.Module):\n"
             "    def __init__(self):\n"
             "        super().__init__()\n"
             "        self.fc = torch.nn.Linear(3 * 8 * 8, 4)\n"
             "    def forward(self, x):\n"
             "        return self.fc(x.flatten(1))\n"
             "def make():\n"
             "    return Net()\n")  # fmt: skip
    kw = {"gpu": "l4", "image_size": 8, "batch_size": 4, "cache": False, "advice": False,
          "max_batch": "off"}  # fmt: skip
    for name, body, words in (
        ("attribute", "    return outputs.no_such_method()\n", r"in its loss\(outputs, inputs\): "),
        (
            "matrix",
            "    return outputs * 2\n",
            r"loss\(outputs, inputs\): ValueError: it must return a scalar tensor, got \(4, 4\)$",
        ),
    ):
        path = tmp_path / f"{name}.py"
        path.write_text(model + "def loss(outputs, inputs):\n" + body)
        with pytest.raises(TraceError, match=words) as err:
            boom_ml.predict(f"file:{path}:make", **kw)
        assert "synthesised" not in str(err.value)


def test_a_bare_name_is_reported_as_its_scheme_names_it() -> None:
    """``model=squeezenet1_1`` traced torchvision's model, and the table's header and JSON's
    ``model`` said only ``squeezenet1_1`` (a layout's said ``hf:gpt2`` for ``gpt2``)."""
    out = boom_ml.predict("squeezenet1_1", gpu="l4", batch_size=1, image_size=32, advice=False,
                          max_batch="off")  # fmt: skip
    assert out.model == out.to_dict()["model"] == "torchvision:squeezenet1_1"


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"optimizer": "lion", "optimizer_impl": "fused"}, "'lion' has no fused implementation"),
        ({"optimizer": "adamw8bit", "optimizer_impl": "fused"}, "runs only its loop"),
        ({"lora_r": 16}, "finetune.r applies to finetune.method=lora or qlora, not full"),
        ({"finetune_method": "lora", "double_quant": False}, "double_quant applies to"),
    ],
)
def test_session_evaluate_refuses_what_predict_refuses(fields, said) -> None:
    """A hunt: Session.evaluate had predicted a fused Lion and LoRA keys under full training,
    which predict() and the CLI refuse; and its hint named boom_ml.StepSpec, which was not
    there."""
    import boom_ml

    step = boom_ml.StepSpec(batch_size=2, seq_len=64, **fields)
    with pytest.raises(InvalidInputError, match=said):
        boom_ml.Session("hf:gpt2").evaluate(step, ["l4"])


def test_advice_arguments_are_predicts_keywords() -> None:
    """An advice item's ``options`` are the CLI's keys (optimizer.impl, finetune.method), no
    Python keywords (a hunt); its ``arguments`` are boom_ml.predict's."""
    import inspect

    from boom_ml.api import _as_microbatches, predict
    from boom_ml.report.advisor import predict_arguments

    settings = {"finetune_method": "qlora", "params_dtype": "bf16", "checkpointing": "full",
                "optimizer_impl": "auto", "batch_size": 1, "grad_accum": 4}  # fmt: skip
    # a LoRA step at r=16 advised QLoRA: the whole mapping, so a merge over the call's own
    # keeps its r (the diff alone would have reset it to 8)
    changed = boom_ml.StepSpec(finetune_method="qlora", lora_r=16, params_dtype="bf16",
                               checkpointing="full", batch_size=1, grad_accum=4)  # fmt: skip
    arguments = predict_arguments(settings, changed)
    assert arguments == {"params_dtype": "bf16", "checkpointing": "full", "optimizer_impl": "auto",
                         "batch_size": 1, "grad_accum": 4,
                         "finetune": {"method": "qlora", "r": 16}}  # fmt: skip
    assert set(arguments) <= set(inspect.signature(predict).parameters)
    assert predict_arguments({"amp": "bf16"}, boom_ml.StepSpec(amp="bf16")) == {"amp": "bf16"}
    # a layout call names its micro-batches as parallel.microbatches, which grad_accum may not
    # stand beside
    assert _as_microbatches({"batch_size": 2, "grad_accum": 4}) == {
        "batch_size": 2,
        "parallel": {"microbatches": 4},
    }
