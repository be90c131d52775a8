"""Describe a compute device for the handshake, the metrics and the report."""
from __future__ import annotations

import os
import platform
import socket
from typing import Any

import psutil

from hetconv.backend import cupy_or_none, gpu_index


def _numpy_blas() -> dict[str, Any] | None:
    """threadpoolctl's description of the BLAS numpy loaded, or None when unknown."""
    try:
        from threadpoolctl import threadpool_info

        found = [info for info in threadpool_info() if info.get("user_api") == "blas"]
    except Exception:  # threadpoolctl is a dependency; a library it cannot read is not fatal
        return None
    return found[0] if found else None


def blas_description() -> str:
    """``openblas 0.3.30, SkylakeX kernels`` (with ``(OPENBLAS_CORETYPE=...)`` when the
    environment chose them), or ``unknown``: one machine's speed can differ twofold by
    the kernels alone (docs/step-speed.md)."""
    info = _numpy_blas()
    if info is None:
        return "unknown"
    chosen = os.environ.get("OPENBLAS_CORETYPE")
    how = f" (OPENBLAS_CORETYPE={chosen})" if chosen else ""
    return (f"{info.get('internal_api')} {info.get('version')}, "
            f"{info.get('architecture', '?')} kernels{how}")


def blas_note() -> str:
    """``numpy BLAS: `` and :func:`blas_description`."""
    return f"numpy BLAS: {blas_description()}"


def blas_kernels() -> str:
    """numpy's BLAS and the kernels it runs, short: ``"openblas SkylakeX"`` (``""`` when
    unknown), for a CPU participant's description."""
    info = _numpy_blas()
    if info is None:
        return ""
    return f"{info.get('internal_api', '?')} {info.get('architecture') or '?'}"


def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_device(device: str, threads: int | None = None) -> dict[str, Any]:
    """A JSON-able description: kind, name, cores, memory, host, pid, threads; for a
    CPU, numpy's BLAS kernels (``blas``)."""
    info: dict[str, Any] = {
        "device": device, "hostname": socket.gethostname(), "pid": os.getpid(),
        "cores": psutil.cpu_count(logical=True) or 1, "threads": threads,
        "memory_bytes": int(psutil.virtual_memory().total),
        "memory_available_bytes": int(psutil.virtual_memory().available),
        "boot_time": int(psutil.boot_time()),  # with the hostname: which share one machine
    }
    if device.startswith("gpu"):
        cupy = cupy_or_none()
        index = gpu_index(device)
        info["kind"] = "gpu"
        if cupy is not None:
            props = cupy.cuda.runtime.getDeviceProperties(index)
            name = props["name"]
            info["name"] = name.decode() if isinstance(name, bytes) else str(name)
            info["memory_bytes"] = int(props["totalGlobalMem"])
            try:
                info["memory_available_bytes"] = int(cupy.cuda.runtime.memGetInfo()[0])
            except Exception:  # a CUDA runtime that cannot say: the total stands
                pass
        else:
            info["name"] = "unavailable"
    else:
        info["kind"] = "cpu"
        info["name"] = cpu_model_name()
        info["blas"] = blas_kernels()
    return info
