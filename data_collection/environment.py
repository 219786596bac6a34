"""Who measured: device identity, software versions and NVML memory for collected rows.

Every collected row names the device and the software stack, because a latency is only
comparable with others measured on the same GPU, driver, CUDA and cuDNN. Rows measured on
the CPU (the ``device=cpu`` dry run) get ``gpu_id="cpu"`` and ``device_kind="cpu"`` so the
training code can never mistake them for GPU measurements.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import re
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class DeviceInfo:
    """Identity columns shared by every row kind."""

    device: torch.device
    gpu_id: str
    device_name: str
    device_kind: str  # "gpu" | "cpu"

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def columns(self) -> dict[str, str]:
        return {
            "gpu_id": self.gpu_id,
            "device_name": self.device_name,
            "device_kind": self.device_kind,
        }


def resolve_device(name: str) -> torch.device:
    """``cuda``/``cuda:N``/``cpu`` → a device; asking for CUDA without one is an error.

    Falling back to the CPU silently would label CPU timings with a GPU run's intent, so
    the harness refuses instead and the user passes ``device=cpu`` explicitly.
    """
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                "device=cuda but no CUDA device is visible; use device=cpu for a dry run"
                " (run_gpu_sweep.py: --device cpu --dry-run)"
            )
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
    elif dev.type != "cpu":
        raise ValueError(f"unsupported device {name!r}: use cuda, cuda:N or cpu")
    return dev


def device_info(dev: torch.device) -> DeviceInfo:
    """gpu_id / device_name / device_kind for ``dev``."""
    if dev.type != "cuda":
        return DeviceInfo(dev, "cpu", _cpu_name(), "cpu")
    name = torch.cuda.get_device_name(dev)
    return DeviceInfo(dev, gpu_id_for(name), name, "gpu")


def gpu_id_for(name: str) -> str:
    """The canonical GPU id for a CUDA device name (boom_ml.gpus), else a slug of the name.

    The slug keeps a new GPU's rows usable (and grouped) before the GPU table knows it.
    """
    try:
        from boom_ml.gpus import resolve_gpu_id  # type: ignore[attr-defined]

        resolved = resolve_gpu_id(name)
        if resolved:
            return str(resolved)
    except Exception:  # noqa: BLE001 - unknown GPU or table not importable: fall back
        pass
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower().replace("nvidia", "")).strip("-")
    return slug or "unknown-gpu"


def _cpu_name() -> str:
    text = platform.processor() or platform.machine() or "cpu"
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    text = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return text


def software_versions() -> dict[str, str | None]:
    """torch / CUDA / cuDNN / driver versions (None where not applicable)."""
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    have_gpu = torch.cuda.is_available()
    return {
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda if have_gpu else None,
        "cudnn_version": str(cudnn) if (cudnn and have_gpu) else None,
        "driver_version": _driver_version() if have_gpu else None,
    }


def _nvml() -> Any | None:
    """The pynvml module (nvidia-ml-py), initialised, or None when it is not installed."""
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # noqa: BLE001 - no NVML library / no driver
        return None


def _driver_version() -> str | None:
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        version = nvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # noqa: BLE001
        return None


def nvml_handle(nvml: Any, dev: torch.device) -> Any:
    """NVML's handle of CUDA device ``dev``: NVML indexes physical devices while
    CUDA_VISIBLE_DEVICES renumbers them; the UUID names the same GPU in both."""
    uuid = getattr(torch.cuda.get_device_properties(dev), "uuid", None)
    try:
        return nvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
    except Exception:  # noqa: BLE001 - older torch without uuid: trust the index
        return nvml.nvmlDeviceGetHandleByIndex(dev.index or 0)


def run_record(device: str) -> dict[str, Any]:
    """What a SOURCE.md needs of a sweep run: when, the command, the releases (torch, CUDA,
    cuDNN, driver, transformers, torchvision, timm) and the GPU (name, memory, SMs, compute
    capability; power limit and maximum clocks from NVML where it answers)."""
    record: dict[str, Any] = {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "argv": sys.argv,
        "python": platform.python_version(), "device": device, **software_versions(),
    }  # fmt: skip
    for module in ("transformers", "torchvision", "timm"):
        try:
            record[f"{module}_version"] = __import__(module).__version__
        except ImportError:
            record[f"{module}_version"] = None
    if not (device.startswith("cuda") and torch.cuda.is_available()):
        return record
    dev = torch.device(device)
    dev = dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(dev)
    record |= {"gpu": props.name, "total_memory_bytes": props.total_memory,
               "sm_count": props.multi_processor_count,
               "compute_capability": f"{props.major}.{props.minor}"}  # fmt: skip
    nvml = _nvml()
    try:
        handle = nvml_handle(nvml, dev)
        record["power_limit_w"] = nvml.nvmlDeviceGetPowerManagementLimit(handle) / 1000
        record["clocks_max_mhz"] = {
            "sm": nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_SM),
            "mem": nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_MEM),
        }
    except Exception as err:  # noqa: BLE001 - a record without NVML still says why
        record["nvml"] = f"unavailable: {type(err).__name__}: {err}"
    return record


@functools.cache
def nvml_baseline() -> dict[int, int]:
    """Used bytes of every device (by NVML index) the first time this process asks: the
    baseline of ``NvmlMemory``'s device-delta reading. One per process, taken before this
    process touches CUDA when the caller asks first thing (``run_gpu_sweep.py`` does), so
    the delta holds the CUDA context and library workspaces whichever sweep reads it."""
    nvml = _nvml()
    if nvml is None:
        return {}
    try:
        return {i: int(nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(i)).used)
                for i in range(nvml.nvmlDeviceGetCount())}  # fmt: skip
    except Exception:  # noqa: BLE001
        return {}


class NvmlMemory:
    """Device memory as NVML sees it: this process's usage, or the device's used-memory delta.

    NVML counts what the caching allocator reserved *plus* the CUDA context and library
    workspaces, which is what decides an out-of-memory on a shared GPU. Sandboxed
    machines (containers, gVisor) often hide process ids from NVML; then the reading is the
    device's used memory minus what was used when this process first asked
    (``nvml_baseline``; the same quantity when this process is the only user), and
    ``method`` says so.
    """

    def __init__(self, dev: torch.device) -> None:
        self.nvml = _nvml() if dev.type == "cuda" else None
        self.handle = None
        self.baseline = 0
        self.method = "none"
        if self.nvml is None:
            return
        first = nvml_baseline()  # before the torch.cuda calls below, if this is the first
        try:
            self.handle = nvml_handle(self.nvml, dev)
            index = int(self.nvml.nvmlDeviceGetIndex(self.handle))
            now = int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used)
            self.baseline = first.get(index, now)
        except Exception:  # noqa: BLE001
            self.handle = None

    def read(self) -> int | None:
        """Bytes this process holds on the device now (see class doc), or None."""
        if self.handle is None:
            return None
        nvml, pid = self.nvml, os.getpid()
        try:
            for fn in (
                "nvmlDeviceGetComputeRunningProcesses_v3",
                "nvmlDeviceGetComputeRunningProcesses",
            ):
                if hasattr(nvml, fn):
                    for proc in getattr(nvml, fn)(self.handle):
                        if proc.pid == pid and proc.usedGpuMemory:
                            self.method = "nvml-process"
                            return int(proc.usedGpuMemory)
                    break
            used = int(nvml.nvmlDeviceGetMemoryInfo(self.handle).used)
            self.method = "nvml-device-delta"
            return max(0, used - self.baseline)
        except Exception:  # noqa: BLE001
            return None


def job_id(prefix: str = "") -> str:
    """A job id unique among concurrent writers: host, process, and Slurm/submitit ids."""
    parts = [prefix] if prefix else []
    parts.append(socket.gethostname().split(".")[0])
    slurm = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    if slurm:
        parts.append(f"slurm{slurm}_{os.environ.get('SLURM_ARRAY_TASK_ID', '0')}")
    parts.append(f"p{os.getpid()}")
    return "-".join(parts)


def set_tf32(enabled: bool) -> None:
    """Allow (or forbid) TF32 in both cuBLAS matmuls and cuDNN convolutions.

    cuDNN allows TF32 by default while cuBLAS does not, so both flags are set explicitly:
    a float32 row must really be IEEE fp32 and a tf32 row must really use TF32.
    """
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


@contextlib.contextmanager
def cpu_threads(dev: torch.device, n: int | None) -> Iterator[None]:
    """Run a CPU sweep with ``n`` intra-op threads, restoring the setting afterwards.

    CPU rows only test the pipeline, and on a shared machine OpenMP threads spinning
    against other processes made a 0.2 s dry-run step take 3 s; one thread avoids that.
    GPU sweeps are left alone (their host threads only launch kernels).
    """
    if dev.type != "cpu" or not n:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(before)
