"""The packaged GPU spec database: look GPUs up by id, alias, device name, or a user YAML file.

Data: ``gpus.csv`` (one row per GPU, with a ``source`` column naming the datasheet, whitepaper or
shared data file behind every value) and ``prices.csv`` (lowest observed on-demand $/GPU-hour,
from the SkyPilot catalog copy in ``shared/data/gpu_specs/observed_cloud_prices.csv``).

Conventions (they matter to the memory and timing models):

* ``memory_bytes`` is the total device memory: the datasheet size read as GiB, i.e.
  ``memory_gb * 2**30`` (an 80 GB H100 gives ``80 * 2**30``). Only where a source records the exact
  total is that used instead; today that is the RTX 3060 (12622168064 bytes, the
  ``total_gpu_memory`` column of the xMem runs in ``shared/data/memory/xmem_rtx3060_runs.csv``).
  ``cudaMemGetInfo`` on a real card reports somewhat less (ECC, driver reservations), so treat
  ``memory_bytes`` as an upper bound on what a process can allocate.
* ``memory_bandwidth_gbs`` is in GB/s (1e9 bytes/s), ``l2_cache_mb`` in MiB.
* TFLOPS are dense (datasheets that quote sparse figures are halved). ``fp16_tflops`` and
  ``bf16_tflops`` are tensor-core rates with FP32 accumulate, which is what PyTorch uses; on
  GeForce parts that is half the FP16-accumulate rate.
* ``architecture`` and ``compute_capability`` follow NVIDIA's CUDA GPUs list.
* An empty cell means no source was found; values are never guessed. ``fp32_tflops``,
  ``memory_*``, ``memory_bandwidth_gbs`` and ``sm_count`` are filled for every row.

Names are matched case-insensitively with spaces, underscores and hyphens ignored, and a leading
"NVIDIA", "GeForce" or "Tesla" optional, so ``"NVIDIA_A100_80GB_PCIe"`` (a NeuSight folder name),
``"NVIDIA A100 80GB PCIe"`` (``torch.cuda.get_device_name()``) and ``"a100-80gb-pcie"`` are one GPU.
"""

from __future__ import annotations

import csv
import functools
import io
import math
import re
import statistics
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from boom_ml.errors import InvalidInputError, UnknownGpuError, close_matches, suggest
from boom_ml.gpus.spec import ARCHITECTURES, GIB, GpuSpec
from boom_ml.gpus.tensor_rates import fill_tensor_rates
from boom_ml.gpus.user_checks import check_ranges

__all__ = [
    "GpuSpec",
    "all_gpus",
    "get_gpu",
    "gpu_aliases",
    "load_user_gpu",
    "parse_gpu_list",
    "resolve_gpu_id",
]

_INT_FIELDS = {"sm_count", "memory_bytes", "total_memory_bytes"}
_FLOAT_FIELDS = {
    "boost_clock_mhz",
    "base_clock_mhz",
    "memory_gb",
    "memory_bandwidth_gbs",
    "l2_cache_mb",
    "fp32_tflops",
    "tf32_tflops",
    "fp16_tflops",
    "bf16_tflops",
    "fp8_tflops",
    "tdp_w",
    "price_usd_per_hour",
}
# Fields a user YAML must give: without them neither the memory nor the timing model can run.
_USER_REQUIRED = (
    "name",
    "architecture",
    "compute_capability",
    "sm_count",
    "memory_gb",
    "memory_bandwidth_gbs",
    "fp32_tflops",
)
# Prefixes that device names carry inconsistently across drivers and data sets
# ("Tesla T4" vs "NVIDIA T4", "GeForce RTX 3090" vs "NVIDIA GeForce RTX 3090").
_OPTIONAL_PREFIXES = ("nvidia", "geforce", "tesla")
_YAML_SUFFIXES = (".yaml", ".yml")
USER_ID = r"[A-Za-z0-9][A-Za-z0-9 ._+()-]*"  # a user spec's id


def _norm(name: str) -> str:
    return re.sub(r"[\s_\-]+", "", str(name).strip().lower())


def _variants(key: str) -> list[str]:
    """The key plus the key with each optional vendor/brand prefix peeled off, in order."""
    out = [key]
    changed = True
    while changed:
        changed = False
        for prefix in _OPTIONAL_PREFIXES:
            if key.startswith(prefix) and len(key) > len(prefix):
                key = key[len(prefix) :]
                out.append(key)
                changed = True
    return out


def _read_rows(filename: str) -> list[dict[str, str]]:
    text = resources.files(__package__).joinpath(filename).read_text(encoding="utf-8")
    # Leading '#' lines carry provenance notes for humans; csv has no comment syntax.
    body = "\n".join(line for line in text.splitlines() if not line.startswith("#"))
    return list(csv.DictReader(io.StringIO(body)))


def _convert(field: str, raw: Any, where: str) -> Any:
    if raw is None or (isinstance(raw, str) and raw.strip() == ""):
        return None
    if isinstance(raw, bool) and field in _INT_FIELDS | _FLOAT_FIELDS:  # YAML's yes/true
        raise InvalidInputError(f"{where}: field '{field}' must be a number, got {raw!r}")
    try:
        if field in _INT_FIELDS:
            value = float(raw)
            if not value.is_integer():
                raise ValueError
            return int(value)
        if field in _FLOAT_FIELDS:
            value = float(raw)
            if not math.isfinite(value):
                raise ValueError
            return value
    except (TypeError, ValueError, OverflowError):
        kind = "an integer" if field in _INT_FIELDS else "a finite number"
        raise InvalidInputError(f"{where}: field '{field}' must be {kind}, got {raw!r}") from None
    return str(raw).strip()


@functools.cache
def _prices() -> dict[str, tuple[float, str]]:
    out = {}
    for row in _read_rows("prices.csv"):
        where = f"{row['provider']} {row['instance']} ({row['region']}), {row['source']}"
        out[row["id"]] = (float(row["usd_per_gpu_hr"]), where)
    return out


@functools.cache
def _capacities() -> dict[str, tuple[int, str]]:
    """Usable memory per GPU id (``capacity.csv``): bytes and where the number comes from."""
    try:
        rows = _read_rows("capacity.csv")
    except FileNotFoundError:
        return {}
    return {
        r["id"]: (int(r["total_memory_bytes"]), f"{r['method']}: {r['source']}".strip())
        for r in rows
    }


@functools.cache
def _table() -> tuple[dict[str, GpuSpec], dict[str, str], dict[str, tuple[str, ...]]]:
    """Parse gpus.csv once: specs by id, normalised alias -> id, and each id's alias strings."""
    specs: dict[str, GpuSpec] = {}
    lookup: dict[str, str] = {}
    aliases: dict[str, tuple[str, ...]] = {}
    prices = _prices()
    capacities = _capacities()
    fields = GpuSpec.field_names()
    for row in _read_rows("gpus.csv"):
        gid = row["id"]
        values = {f: _convert(f, row[f], f"gpus.csv row {gid}") for f in fields if f in row}
        price = prices.get(gid)
        values["price_usd_per_hour"], values["price_source"] = price if price else (None, None)
        if gid in capacities:
            values["total_memory_bytes"], values["capacity_source"] = capacities[gid]
        specs[gid] = GpuSpec(**values)
        names = [gid, row["name"], *(a for a in row["aliases"].split(";") if a.strip())]
        aliases[gid] = tuple(names[2:])
        for name in names:
            for key in _variants(_norm(name)):
                # A clash would silently route one GPU's name to another: fail loudly instead.
                if lookup.setdefault(key, gid) != gid:
                    raise RuntimeError(
                        f"gpus.csv: alias {name!r} maps to both {lookup[key]} and {gid}"
                    )
    unknown = set(capacities) - set(specs)
    if unknown:
        raise RuntimeError(f"capacity.csv: ids not in gpus.csv: {sorted(unknown)}")
    unknown_prices = set(prices) - set(specs)
    if unknown_prices:
        raise RuntimeError(f"prices.csv: ids not in gpus.csv: {sorted(unknown_prices)}")
    return specs, lookup, aliases


def _unknown(name: str) -> UnknownGpuError:
    ids = list(_table()[0])
    key = _norm(name)
    # "h100" should point at every H100, which difflib's similarity ratio misses.
    prefixed = [i for i in ids if key and _norm(i).startswith(key)]
    if not prefixed:  # "a100x": the ids its longest known prefix starts (every A100) first,
        # then difflib's (which offered a10, a10g, h100-sxm)
        near = next((found for n in range(len(key) - 1, 2, -1)
                     if (found := [i for i in ids if _norm(i).startswith(key[:n])])), [])  # fmt: skip
        prefixed = list(dict.fromkeys(near[:4] + close_matches(name, ids)))
    hint = f" (did you mean: {', '.join(prefixed[:6])}?)" if prefixed else ""
    return UnknownGpuError(
        f"unknown GPU '{name}'{hint}; `python -m boom_ml.gpus` lists known GPUs, "
        "or pass a .yaml file describing your own"
    )


def resolve_gpu_id(name: str) -> str:
    """Canonical id for an id, alias, marketing name or ``torch.cuda.get_device_name()`` string."""
    _, lookup, _ = _table()
    for key in _variants(_norm(name)):
        if key in lookup:
            return lookup[key]
    raise _unknown(name)


def all_gpus() -> list[GpuSpec]:
    """Every packaged GPU, in table order (by architecture, oldest first)."""
    return list(_table()[0].values())


def gpu_aliases(gpu_id: str) -> tuple[str, ...]:
    """The alias strings listed for a packaged GPU (besides its id and name)."""
    return _table()[2][resolve_gpu_id(gpu_id)]


def get_gpu(name_or_path: str | Path | GpuSpec) -> GpuSpec:
    """Look up a packaged GPU by id/alias/device name, or load a user spec from a .yaml/.yml path."""
    if isinstance(name_or_path, GpuSpec):
        return name_or_path
    if isinstance(name_or_path, Path) or str(name_or_path).lower().endswith(_YAML_SUFFIXES):
        return load_user_gpu(name_or_path)
    return _table()[0][resolve_gpu_id(str(name_or_path))]


def parse_gpu_list(value: Any) -> list[GpuSpec]:
    """GPUs from a CLI/Hydra value: "all", an id, "a,b", or any sequence of those (ListConfig too).

    Duplicates are dropped, so "all,h100-sxm" lists H100 once; two different GPUs with one
    id (a YAML file naming itself h100-sxm beside the table's) are an error.
    """
    if value is None:
        raise InvalidInputError("no GPU given (use an id, a list of ids, a .yaml path, or 'all')")
    if isinstance(value, bool):
        raise InvalidInputError(
            f"gpu={str(value).lower()} names no GPU (use an id, a list of ids, a .yaml path, or"
            " 'all')"
        )
    if isinstance(value, (int, float)):
        value = str(value)  # gpu=4090: Hydra reads a number, which names no GPU yet
    if isinstance(value, (str, Path, GpuSpec)):
        items: list[Any] = [value]
    elif isinstance(value, Iterable) and not isinstance(value, Mapping):
        items = list(value)
    else:
        raise InvalidInputError(f"cannot read a GPU list from {value!r}")
    out: dict[str, GpuSpec] = {}
    for item in items:
        parts = item.split(",") if isinstance(item, str) else [item]
        for part in parts:
            if isinstance(part, str) and not part.strip():
                continue
            if isinstance(part, str) and _norm(part) == "all":
                specs = all_gpus()
            else:
                specs = [get_gpu(part.strip() if isinstance(part, str) else part)]
            for spec in specs:
                seen = out.setdefault(spec.id, spec)
                if seen is spec:
                    continue
                _check_same(seen, spec)
    if not out:
        raise InvalidInputError(f"no GPU given in {value!r}")
    return list(out.values())


def _check_same(seen: GpuSpec, spec: GpuSpec) -> None:
    """Two GPUs of one id must be the same GPU: a YAML file naming itself as another, which?"""
    a, b = seen.to_dict(), spec.to_dict()
    # the id as written may be an alias of the other's (a copy named "A100 80GB SXM")
    differ = [f"{k} {_shown(a[k])} and {_shown(b[k])}" for k in a
              if not _same(a[k], b[k]) and not k.endswith("source") and k != "id"]  # fmt: skip
    if differ:
        raise InvalidInputError(
            f"two different GPUs are named {spec.id!r} ({', '.join(differ[:3])}); "
            "give the YAML file another id"
        )


def _same(a: Any, b: Any) -> bool:
    """Equal, NaN equal to NaN (an unknown field of a GpuSpec built in Python)."""
    return a == b or (a != a and b != b)


def _shown(value: Any) -> Any:
    return f"{value:g}" if isinstance(value, float) else value


def load_user_gpu(path: str | Path) -> GpuSpec:
    """Load a GPU described in a YAML file (e.g. an unreleased part) with GpuSpec field names.

    Required: name, architecture, compute_capability, sm_count, memory_gb, memory_bandwidth_gbs,
    fp32_tflops. ``id`` defaults to the file name, ``memory_bytes`` to ``memory_gb * 2**30``,
    ``total_memory_bytes`` (what PyTorch reports: what a process can use) to the share of it
    the packaged GPUs of its architecture report, ``source`` to the file path; every other
    field defaults to None (unknown).
    """
    import yaml  # local: only user specs need it

    path = Path(path)
    if not path.is_file():
        raise InvalidInputError(f"GPU spec file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise InvalidInputError(f"{path}: not a UTF-8 text file") from None
    except yaml.YAMLError as err:
        raise InvalidInputError(f"{path}: not valid YAML ({_yaml_problem(err)})") from None
    if data is None:
        raise InvalidInputError(f"{path}: the file is empty (a GPU spec is a mapping of fields)")
    if not isinstance(data, dict):
        raise InvalidInputError(
            f"{path}: expected a mapping of GpuSpec fields, got {type(data).__name__}"
        )

    fields = GpuSpec.field_names()
    unknown = sorted(str(k) for k in data if k not in fields)
    if unknown:
        # one parenthesis for all (two misspelt keys had printed two after each other)
        hints = [h.strip(" ()?").removeprefix("did you mean: ") for k in unknown
                 if (h := suggest(k, fields, n=1))]  # fmt: skip
        hint = f" (did you mean: {', '.join(hints)}?)" if hints else ""
        raise InvalidInputError(
            f"{path}: unknown GPU spec field(s): {', '.join(unknown)}{hint}; "
            f"allowed: {', '.join(fields)}"
        )
    missing = [f for f in _USER_REQUIRED if data.get(f) is None]
    if missing:
        raise InvalidInputError(f"{path}: missing required GPU spec field(s): {', '.join(missing)}")

    values = {f: _convert(f, data.get(f), str(path)) for f in fields}
    values["id"] = values["id"] or _norm_id(path.stem)
    if not re.fullmatch(USER_ID, values["id"]):
        # it names the figures plot= writes ('My GPU/x' had crashed the run) and the rows
        raise InvalidInputError(
            f"{path}: id {values['id']!r} must be letters, digits, spaces and . _ + - ( ),"
            " starting with a letter or digit"
        )
    if not re.fullmatch(r"\d+(\.\d+)?", values["compute_capability"]):
        raise InvalidInputError(
            f"{path}: compute_capability must look like '9.0', got {values['compute_capability']!r}"
        )
    _check_architecture(values, path)
    check_ranges(values, str(path), all_gpus())
    if values["memory_bytes"] is None:
        values["memory_bytes"] = int(values["memory_gb"] * GIB)
    values["source"] = values["source"] or f"user spec {path}"
    if values["total_memory_bytes"] is None:
        values["total_memory_bytes"], values["capacity_source"] = _usable_memory(values)
    filled = fill_tensor_rates(values, all_gpus())
    if filled:
        values["source"] += (
            f"; {', '.join(filled)} not given: from a rate given, by the ratio the packaged "
            f"GPUs of compute capability {values['compute_capability']} (else of "
            f"{values['architecture']}) show, else their median rate per SM and MHz"
        )
    # a spec may take a packaged GPU's id (a what-if copy with fields changed: it is not that
    # GPU, tests/test_basis.py); beside that GPU in one list it is refused (parse_gpu_list)
    return GpuSpec(**values)


def _usable_memory(values: dict[str, Any]) -> tuple[int, str]:
    """What PyTorch would report as a user GPU's total memory, where its spec does not say
    (``total_memory_bytes``): its ``memory_bytes`` times the median share the packaged GPUs
    of its architecture report (``capacity.csv``; all of them where none is listed). The
    packaged GPUs lose 1-8 % of the sheet's memory to ECC and the driver: taking the sheet's
    whole was optimistic about what fits."""
    arch = [
        g for g in all_gpus() if g.total_memory_bytes and g.architecture == values["architecture"]
    ]
    pool = arch or [g for g in all_gpus() if g.total_memory_bytes]
    share = statistics.median(g.total_memory_bytes / g.memory_bytes for g in pool)
    scope = f"{values['architecture']} GPUs" if arch else "GPUs"
    return int(values["memory_bytes"] * share), (
        f"not given: memory_bytes x {share:.4f}, the median share the packaged {scope} report"
        " (boom_ml/gpus/capacity.csv; total_memory_bytes in the spec sets it)"
    )


def _yaml_problem(err: Exception) -> str:
    """PyYAML's message on one line: where, then what (its own text spans several lines)."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or " ".join(str(err).split())
    return (f"line {mark.line + 1}, column {mark.column + 1}: " if mark else "") + problem


def _check_architecture(values: dict[str, Any], path: Path) -> None:
    """The memory and timing models pick workspaces, kernels and links by architecture and
    compute capability: both must be ones the package knows, and agree."""
    arch = values["architecture"].lower()
    if arch not in ARCHITECTURES:
        raise InvalidInputError(
            f"{path}: unknown architecture {values['architecture']!r}"
            f"{suggest(arch, ARCHITECTURES, n=1)}; choose one of: {', '.join(ARCHITECTURES)}"
        )
    values["architecture"] = arch
    major, _, minor = values["compute_capability"].partition(".")
    lo, hi = ARCHITECTURES[arch]
    if not lo <= int(major) * 10 + int(minor or 0) <= hi:
        known = ", ".join(f"{a} {_capabilities(a)}" for a in ARCHITECTURES)
        raise InvalidInputError(
            f"{path}: compute_capability {values['compute_capability']} does not match "
            f"architecture {arch} ({_capabilities(arch)}); known: {known}"
        )


def _capabilities(arch: str) -> str:
    """``ARCHITECTURES[arch]`` as compute capabilities: "8.0-8.7", or "9.0" alone."""
    lo, hi = (f"{v // 10}.{v % 10}" for v in ARCHITECTURES[arch])
    return lo if lo == hi else f"{lo}-{hi}"


def _norm_id(stem: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", stem.lower()).strip("-")
