"""`python -m boom_ml.predict`: memory and step time of one training step, per GPU.

Examples:
  python -m boom_ml.predict model=hf:gpt2 gpu=[a100-80gb-sxm,h100-sxm,l4] batch_size=8 seq_len=1024 amp=bf16 output=json
  python -m boom_ml.predict model=torchvision:resnet50 gpu=all batch_size=64
Run with --help for every option (Hydra syntax: key=value).

From Python, ``boom_ml.predict(model=..., gpu=..., batch_size=...)`` calls
:func:`boom_ml.api.predict` (``help(boom_ml.api.predict)`` lists its keywords; nested keys
are dicts: ``finetune={"method": "lora"}``, ``parallel={"dp": 2}``) and returns a Prediction
(``result.to_dict()`` is the JSON document).

Everything the user typed is checked before torch or a model library is imported (they take
seconds to import; a typo should answer at once): keys against configs/predict.yaml, the model
spec's syntax, GPU ids and YAML GPU files, numbers and choices. This module therefore imports
nothing heavy at module level, and neither may the modules it validates with.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import json
import os
import sys
import types
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from boom_ml import config_help
from boom_ml.errors import BoomError, InvalidInputError, suggest
from boom_ml.estimates import finite
from boom_ml.gpus import parse_gpu_list
from boom_ml.parallel.layout import (
    Cluster,
    Layout,
    as_one_gpu,
    check_cluster_keys,
    for_parallel_step,
)
from boom_ml.parallel.layout import validate as check_layout
from boom_ml.parallel.shard import config_facts
from boom_ml.report.plot_dir import check_plot_dir
from boom_ml.specs import (
    ATTENTION_CHOICES,
    StepSpec,
    bool_word,
    cache_setting,
    check_bool,
    check_choice,
    check_model_options,
    check_model_syntax,
    finetune_fields,
    max_batch_setting,
)
from boom_ml.stack import resolve_optimizer_impl, resolve_stack

CONFIG_DIR = str(config_help.CONFIG_DIR)
OUTPUTS = ("table", "json")
# the group whose keys are the model constructor's, free-form (model_options.aux_logits=false)
OPEN_GROUP = "model_options"
BOOL_KEYS = ("explain", "advice", "tf32", "channels_last", "master_weights")
NULLABLE_BOOL_KEYS = ("tf32_matmul", "tf32_cudnn")  # null: PyTorch's default
NESTED_BOOL_KEYS = {
    "finetune": ("double_quant",),
    "parallel": ("bucket_view",),
    "stack": ("cudnn_benchmark", "expandable_segments"),
}
# argv spellings rewritten before Hydra parses them: {alias key: config key}
KEY_ALIASES = {"optimizer.impl": "optimizer_impl", "checkpointing.every": "checkpointing_every"}
LIST_KEYS = ("gpu", "finetune.targets")  # a bare comma list is the list (see rewrite_aliases)
# release numbers, which YAML would read as numbers (stack.torch=2.10 as 2.1): kept as text
VERSION_KEYS = ("stack.torch", "stack.cuda", "stack.cudnn")

# Other tools' names for a key, which no spelling distance finds (format=json is output=json)
OTHER_NAMES = {"format": "output", "json": "output=json", "gpus": "gpu", "precision": "amp",
               "mixed_precision": "amp", "bs": "batch_size", "batch": "batch_size",
               "seq_length": "seq_len", "sequence_length": "seq_len", "dtype": "params_dtype",
               "gradient_checkpointing": "checkpointing",
               "gradient_accumulation_steps": "grad_accum"}  # fmt: skip


def suggest_key(key: str, known: Iterable[str]) -> str:
    """The hint after an unknown key, ``(did you mean: ...?)``: the key another tool's name
    stands for, else the closest known keys."""
    alias = OTHER_NAMES.get(key.lower())
    return f" (did you mean: {alias}?)" if alias else suggest(key, known)


@functools.cache
def config_keys(config_name: str = "predict") -> frozenset[str]:
    """Every key of ``configs/<config_name>.yaml``, nested ones dotted (``stack.torch``)."""
    return frozenset(_keys_in_order(config_name))


def _keys_in_order(config_name: str) -> tuple[str, ...]:
    return tuple(_config_tree(config_name))


@functools.lru_cache(maxsize=8)
def _config_tree(config_name: str) -> dict[str, bool]:
    """Every key of ``configs/<config_name>.yaml`` in order, nested ones dotted: whether its
    value is a mapping (``+data.exclude_gpus.a40=why`` adds a key to one)."""
    import yaml  # PyYAML: a few ms, and Hydra needs it anyway

    data = yaml.safe_load((Path(CONFIG_DIR) / f"{config_name}.yaml").read_text()) or {}
    keys: dict[str, bool] = {}

    def walk(mapping: Mapping[str, Any], prefix: str) -> None:
        for key, value in mapping.items():
            if prefix == "" and key in ("defaults", "hydra"):
                continue  # Hydra's own; `hydra.*` overrides are passed through
            keys[prefix + str(key)] = isinstance(value, Mapping)
            if isinstance(value, Mapping):
                walk(value, f"{prefix}{key}.")

    walk(data, "")
    return keys


def rewrite_aliases(argv: list[str]) -> list[str]:
    """``optimizer.impl=X`` → ``optimizer_impl=X`` (``optimizer`` is a string, not a mapping),
    ``gpu=a100,h100`` → ``gpu=[a100,h100]`` for the keys that take a list (Hydra reads a
    bare comma list as a sweep and, without ``--multirun``, stops with "Ambiguous value"),
    release numbers quoted (``stack.torch=2.10`` is not the number 2.1), and
    ``model_options.K=V`` added as a new key (the constructor's keys cannot be listed)."""
    sweep = any(arg in ("-m", "--multirun") for arg in argv)
    out = []
    for arg in argv:
        prefix = arg[: len(arg) - len(arg.lstrip("+~"))]
        key, sep, value = arg[len(prefix) :].partition("=")
        key = KEY_ALIASES.get(key, key)
        if key in LIST_KEYS and "," in value and not sweep and value[:1] not in "[('\"":
            value = f"[{value}]"
        if key in VERSION_KEYS and value and value[:1] not in "'\"" and value != "null":
            value = f"'{value}'"
        if key.startswith(OPEN_GROUP + ".") and not prefix:
            prefix = "+"  # a key the config cannot list (Hydra needs "+" to add it)
        out.append(f"{prefix}{key}{sep}{value}" if sep else arg)
    return out


def _not_key_value(arg: str, previous: str | None, known: list[str]) -> InvalidInputError:
    """One line for a command-line word that is neither key=value nor one of Hydra's flags."""
    name = arg.lstrip("-").partition("=")[0]
    if arg.startswith("-"):
        if name in known:
            return InvalidInputError(f"unknown flag {arg!r}: give it as {name}=...")
        return InvalidInputError(
            f"unknown flag {arg!r}: options are key=value{suggest(name, known)}"
        )
    if previous is not None and any(previous.count(a) > previous.count(b) for a, b in ("[]", "{}")):
        return InvalidInputError(
            f"{previous!r} and {arg!r} are one value split at a space: quote it "
            f'("{previous} {arg}") or leave the space out'
        )
    hint = f"give it as {arg}=..." if arg in known else "give every option as key=value"
    return InvalidInputError(f"{arg!r} is not key=value: {hint}")


def _hydra_words(argv: list[str]) -> tuple[list[str], list[str], Any]:
    """(overrides, words Hydra's parser leaves over, its flags) as Hydra's own argparse
    splits ``argv`` (its flags, their values, abbreviations such as --multi)."""
    from hydra._internal.utils import get_args_parser

    args, rest = get_args_parser().parse_known_args(argv)
    return list(args.overrides or []), rest, args


def check_override_keys(argv: list[str], config_name: str = "predict") -> None:
    """Reject ``typo=value`` with one line instead of Hydra's multi-line struct error, and
    a value given to a group of keys (``parallel=4``), which Hydra also rejects in lines;
    so too a word that is not key=value (``gpu=[l4, t4]`` unquoted, ``--gpu l4``), which
    Hydra's parser or argparse would answer in lines."""
    known = config_keys(config_name)
    overrides, rest, flags = _hydra_words(argv)
    if flags.shell_completion:
        return  # -sc install=bash: the words are the completion's, not options
    for arg in rest:
        if not arg.startswith("-") and "=" in arg:  # argparse reads one run of them
            raise InvalidInputError(
                f"{arg!r} comes after a flag that follows other key=value options: give the "
                "key=value options together, before or after the flags"
            )
        raise _not_key_value(arg, None, known)
    seen: dict[str, str] = {}
    for i, arg in enumerate(overrides):
        if arg.startswith("~") and "=" not in arg:
            continue  # Hydra's deletion of a key
        if "=" not in arg:
            raise _not_key_value(arg, overrides[i - 1] if i else None, known)
        key, _, value = arg.partition("=")
        key = key.lstrip("+~")
        if key in seen and not flags.multirun:
            # Hydra keeps the last silently; with two spellings (optimizer.impl= and
            # optimizer_impl=) the user cannot tell which one won
            # key={a:1,b:2} unquoted: the shell's brace expansion makes key=a:1 key=b:2 (only
            # for a key that takes a mapping: model=hf:gpt2 model=hf:gpt2-medium is no such)
            mapping = key == OPEN_GROUP or _config_tree(config_name).get(key, False)
            braces = mapping and ":" in seen[key] and ":" in value and "{" not in seen[key] + value
            raise InvalidInputError(
                f"{key} is given twice ({seen[key]!r} and {value!r}); give it once"
                + (f" (the shell split {key}={{...}} at its commas: quote it, "
                   f"'{key}={{{seen[key]},{value}}}')" if braces else "")
            )  # fmt: skip
        seen[key] = value
        if key == "hydra" or key.startswith(("hydra.", "hydra/")):
            continue
        added = arg.startswith("+") and _config_tree(config_name).get(key.rpartition(".")[0])
        if key not in known and not key.startswith(OPEN_GROUP + ".") and not added:
            raise InvalidInputError(f"unknown option {key!r}{suggest_key(key, known)}")
        if value.strip() not in ("", "null") and not value.lstrip().startswith("{"):
            check_group(key, value, config_name)
    _check_grammar(overrides)


def exit_on_bad_overrides(argv: list[str], config_name: str) -> None:
    """:func:`check_override_keys` for an entry point: its error in one line on stderr, and
    exit 2, before Hydra answers in lines (the training and predict_ops entries)."""
    try:
        check_override_keys(argv, config_name)
    except BoomError as err:
        _fail(err)


def _check_grammar(overrides: list[str]) -> None:
    """A value Hydra's override grammar cannot read (``gpu=[l4``, ``model=a=b``): one line,
    where Hydra prints its parser's lines and a pointer to its docs and exits 1."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    for arg in overrides:
        try:
            parser.parse_overrides([arg])
        except OverrideParseException as err:
            why = str(err).strip().splitlines()[0] if str(err).strip() else "unreadable"
            raise InvalidInputError(
                f"{arg!r} does not parse ({why}): close its brackets and braces, and quote a"
                " value that holds = or spaces for Hydra inside the shell's quotes:"
                " \"key='a=b'\""
            ) from err


def check_group(key: str, value: Any, config_name: str = "predict") -> None:
    """``key`` names a group of keys (``parallel``, ``cluster``): it takes no plain value."""
    children = [k for k in _keys_in_order(config_name) if k.startswith(f"{key}.")]
    if children and not isinstance(value, Mapping):
        raise InvalidInputError(
            f"{key} takes keys ({children[0]}=..., ...), not a value: got {value!r}"
        )


def _switch_words_as_bools(options: dict[str, Any]) -> None:
    """advice=off, finetune.double_quant=no, ...: a switch's word as the bool it says."""
    for name in (*BOOL_KEYS, *NULLABLE_BOOL_KEYS):
        if name in options:
            options[name] = bool_word(options[name])
    for group, names in NESTED_BOOL_KEYS.items():
        if isinstance(options.get(group), Mapping):
            options[group] = {
                k: bool_word(v) if k in names else v for k, v in options[group].items()
            }


def validate(options: Mapping[str, Any]) -> dict[str, Any]:
    """Check every option without importing torch; returns them with ``cache`` as a bool.

    Raises the same one-line :class:`BoomError` that the prediction itself would, so a
    typo costs milliseconds instead of the seconds torch takes to import.
    """
    options = dict(options)
    unknown = sorted(set(options) - config_keys())
    if unknown:
        raise InvalidInputError(
            f"unknown option(s): {', '.join(unknown)}{suggest_key(unknown[0], config_keys())}"
        )
    if options.get("output", "table") not in OUTPUTS:
        raise InvalidInputError(
            f"unknown output {options['output']!r}; choose one of: {', '.join(OUTPUTS)}"
        )
    _switch_words_as_bools(options)
    for name in BOOL_KEYS:
        if name in options:
            check_bool(name, options[name])
    for name in NULLABLE_BOOL_KEYS:
        if options.get(name) is not None:
            check_bool(name, options[name])
    if "cache" in options:
        options["cache"] = cache_setting(options["cache"])
    if "max_batch" in options:
        options["max_batch"] = max_batch_setting(options["max_batch"])
    check_model_syntax(options.get("model"))
    check_model_options(options.get("model_options"))
    check_choice("attention", options.get("attention", "sdpa"), ATTENTION_CHOICES)
    step_fields = {f.name for f in dataclasses.fields(StepSpec)}
    step = {k: v for k, v in options.items() if k in step_fields}
    StepSpec(**step, **finetune_fields(options.get("finetune")))  # ranges and choices
    parse_gpu_list(options.get("gpu"))  # ids, aliases, YAML files: gpus.csv read with csv
    stack = resolve_stack(options.get("stack"))  # stacks.csv, read without torch
    if "optimizer_impl" in options:
        resolve_optimizer_impl(options.get("optimizer", "adamw"), options["optimizer_impl"], stack)
    for group in ("parallel", "cluster"):  # from the API: parallel=4 is no layout
        if options.get(group) is not None:
            check_group(group, options[group])
    layout, grad_accum = as_one_gpu(
        Layout(**(options.get("parallel") or {})), options.get("grad_accum", 1)
    )
    layout = for_parallel_step(
        layout,
        grad_accum=grad_accum,
        max_batch_on=options.get("max_batch") == "on",
    )
    cluster = Cluster(**(options.get("cluster") or {}))
    check_layout(
        layout,
        cluster,
        **({} if layout.is_single else config_facts(str(options.get("model") or ""))),
        finetune_method=options.get("finetune_method"),
        optimizer=options.get("optimizer"),
    )
    check_cluster_keys(layout, cluster, bool(options.get("advice", True)))
    plot = options.get("plot")
    if plot is not None:
        check_plot_dir(plot)  # a non-path or unwritable directory fails here, not after the trace
    return options


def run(cfg: Any) -> str:
    """Plain function behind the CLI: a config mapping in, the rendered output out."""
    if not isinstance(cfg, dict):  # Hydra's DictConfig, a Mapping whose nested values stay
        # DictConfig / ListConfig (model_options.rope_scaling={...} reached transformers so)
        from omegaconf import OmegaConf

        if OmegaConf.is_config(cfg):
            cfg = OmegaConf.to_container(cfg, resolve=True)
    options = validate(cfg)  # before the imports below: they take seconds
    output = options.pop("output", "table")
    explain = bool(options.pop("explain", False))

    from boom_ml.cli_imports import lightgbm_alone

    lightgbm_alone()  # scikit-learn, which lightgbm would import, costs ~1 s
    from boom_ml.api import predict
    from boom_ml.report.table import render_table

    known = set(inspect.signature(predict).parameters)  # its own, through the decorator
    unknown = sorted(set(options) - known)
    if unknown:
        raise InvalidInputError(f"unknown option(s): {', '.join(unknown)}")
    # what the model's own code prints goes to stderr: stdout holds the table or the JSON
    # alone (a forward that printed had put its lines before the JSON document; a hunt)
    with contextlib.redirect_stdout(sys.stderr):
        prediction = predict(**options)
    if output == "json":
        return to_json(prediction.to_dict())
    text = render_table(prediction, explain=explain)
    if prediction.plots:
        text += "\nplots: " + ", ".join(prediction.plots)
    return text


def to_json(doc: Any) -> str:
    """``doc`` as strict JSON: NaN and infinities (a value the models could not give) become
    null, since JSON has no spelling for them and Python's bare ``NaN`` breaks other parsers."""
    return json.dumps(finite(doc), indent=2, allow_nan=False)


def _fail(err: BoomError) -> None:
    print(f"error: {err}", file=sys.stderr)
    sys.exit(err.exit_code)


def main() -> None:
    # transformers' notices about configs we build on purpose are noise on a terminal
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    sys.argv[1:] = rewrite_aliases(sys.argv[1:])
    try:
        config_help.require_configs()
        check_override_keys(sys.argv[1:])
    except BoomError as err:
        _fail(err)

    import hydra  # ~0.15 s; composes the config, values are checked in run() before torch

    from boom_ml import progress, trace_pool

    progress.to_terminal()  # a status line on stderr while tracing, when it is a terminal
    trace_pool.use_by_default()  # traces known in advance run side by side in workers

    @hydra.main(config_path=CONFIG_DIR, config_name="predict", version_base="1.3")
    def _entry(cfg: Any) -> None:
        try:
            print(run(cfg))
        except BoomError as err:
            _fail(err)

    try:
        _entry()
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback; workers end with us
        print("interrupted", file=sys.stderr)
        sys.exit(130)


class _CallableModule(types.ModuleType):
    """Lets ``boom_ml.predict(model=..., gpu=...)`` call :func:`boom_ml.api.predict`.

    The CLI contract fixes the module name ``boom_ml.predict`` and the Python API fixes
    the call ``boom_ml.predict(...)``; a callable module satisfies both.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from boom_ml.api import predict

        return predict(*args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        """The API's keywords, for ``inspect.signature`` and IDEs (the call's own are
        ``*args, **kwargs``); imported when asked, as the call imports it."""
        from boom_ml.api import predict

        return inspect.signature(predict)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    main()
