"""Is the device free? Read before JAX's backend starts, so a busy device fails in seconds.

JAX's GPU backend takes ``XLA_PYTHON_CLIENT_MEM_FRACTION`` of the device when it starts
(``reserve_device_memory`` sets it from ``--gpu-memory-utilization``). When another process
already holds that memory, the allocator backs off and retries allocation after allocation for
minutes; ``check_free_memory`` compares what the device has free, across all processes, with
what the fraction asks for, before anything touches the device, and says what to do.
``jaxserve launch`` calls it first; ``is_out_of_memory`` recognises a later allocation failure
(weights, compiled programs, the KV cache) so start-up ends with one message.

The reading comes from NVML on CUDA hosts. On TPU and CPU hosts there is nothing to read
before the backend starts (a TPU is held by one process, which a second one is refused at
once; the CPU has no device memory), so the check is skipped there, with the reason logged.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Callable

_LOG = logging.getLogger(__name__)
GiB = 1024**3


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    index: int  # the device's place among those this process sees
    name: str
    free_bytes: int  # free for a new process: other processes' memory is not
    total_bytes: int  # usable: what CUDA reports, the driver's reservation left out


# Every device this process sees, or why there is nothing to check. Tests pass their own.
MemoryQuery = Callable[[], list[DeviceMemory] | str]


def nvml_device_memory() -> list[DeviceMemory] | str:
    """Free and usable memory of every CUDA device this process sees.

    NOTE: through ``nvidia-ml-py`` (``pynvml``), NVIDIA's own bindings, rather than ctypes on
    libnvidia-ml.so.1: it finds the library where each driver install puts it and maps NVML's
    versioned structs and error codes, and, being a Python module, a test or a CPU rehearsal
    of the benchmark script can put a fake one first on PYTHONPATH.
    """
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and not {"cuda", "gpu"} & set(platforms.lower().split(",")):
        return f"JAX_PLATFORMS={platforms} leaves out CUDA"
    try:
        import pynvml
    except ImportError:
        if os.path.exists("/proc/driver/nvidia"):
            return "nvidia-ml-py is not installed (pip install nvidia-ml-py, or jaxserve[cuda])"
        return "no NVIDIA driver"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return f"NVML did not start ({exc}): no usable NVIDIA driver"
    try:
        handles = _visible_handles(pynvml)
        if isinstance(handles, str):
            return handles
        return [_read(pynvml, i, handle) for i, handle in enumerate(handles)]
    except pynvml.NVMLError as exc:
        return f"NVML could not read the devices ({exc})"
    finally:
        pynvml.nvmlShutdown()


def _visible_handles(pynvml) -> list | str:
    """NVML handles of the devices CUDA shows this process, in CUDA's order.

    NOTE: a number in CUDA_VISIBLE_DEVICES is taken as NVML's index, which is CUDA's own on
    a host of identical GPUs (CUDA orders the fastest first, then by PCI bus, as NVML does).
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    handles = []
    for entry in filter(None, (e.strip() for e in visible.split(","))):
        if entry.isdigit():
            handles.append(pynvml.nvmlDeviceGetHandleByIndex(int(entry)))
        elif entry.startswith("GPU-"):
            handles.append(pynvml.nvmlDeviceGetHandleByUUID(entry))
        else:
            return f"CUDA_VISIBLE_DEVICES entry {entry!r} is not a GPU index or UUID"
    return handles or "CUDA_VISIBLE_DEVICES names no device"


def _read(pynvml, index: int, handle) -> DeviceMemory:
    name = pynvml.nvmlDeviceGetName(handle)
    version = getattr(pynvml, "nvmlMemory_v2", None)
    try:  # v2 tells the driver's reservation apart; CUDA's total leaves it out
        info = pynvml.nvmlDeviceGetMemoryInfo(handle, version=version)
        reserved = getattr(info, "reserved", 0)
    except (pynvml.NVMLError, TypeError):  # an old driver or binding: version 1
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        reserved = 0
    name = name.decode() if isinstance(name, bytes) else str(name)
    return DeviceMemory(index, name, int(info.free), int(info.total) - int(reserved))


class DeviceMemoryError(RuntimeError):
    """The device cannot give what ``--gpu-memory-utilization`` asks for."""


def check_free_memory(memory_utilization: float, query: MemoryQuery = nvml_device_memory) -> None:
    """Raise ``DeviceMemoryError`` if a device has less free memory than ``memory_utilization``
    of its total, the share JAX's allocator will take when the backend starts.

    NOTE: every visible device, not only those the model will use: the backend takes its share
    of each GPU it sees (CUDA_VISIBLE_DEVICES chooses which)."""
    devices = query()
    if isinstance(devices, str):
        _LOG.debug("Free device memory not checked: %s", devices)
        return
    for device in devices:
        requested = int(memory_utilization * device.total_bytes)
        if device.free_bytes >= requested:
            continue
        fits = math.floor(device.free_bytes / device.total_bytes * 100) / 100
        lower = f"lower --gpu-memory-utilization to at most {fits:.2f}, " if fits >= 0.01 else ""
        others = (
            ", or leave this device out with CUDA_VISIBLE_DEVICES (JAX takes its share of every "
            "GPU it sees)"
            if len(devices) > 1
            else ""
        )
        raise DeviceMemoryError(
            f"Device {device.index} ({device.name}) has {device.free_bytes / GiB:.2f} GiB free "
            f"of {device.total_bytes / GiB:.2f} GiB, but --gpu-memory-utilization "
            f"{memory_utilization:g} asks for {requested / GiB:.2f} GiB: another process holds "
            f"the rest (nvidia-smi lists it). To start, {lower}or stop the other "
            f"process{others}."
        )


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is XLA's failure to allocate device (or host) memory."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()
    )


def out_of_memory_message(exc: BaseException, memory_utilization: float) -> str:
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (
        f"Out of device memory while starting ({first_line}). The plan above gave the KV cache "
        f"what was left of --gpu-memory-utilization {memory_utilization:g} after the weights: "
        "lower --gpu-memory-utilization, --max-model-len or --max-num-batched-tokens, or stop "
        "the other process using the device."
    )
