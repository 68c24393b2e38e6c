"""What the machine has, measured at the time of asking: cores, memory, disk, GPUs (NVML)."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import psutil

from wire.state import GpuJson, Inventory


@dataclass(frozen=True, slots=True)
class Gpu:
    index: int
    name: str
    uuid: str
    memory_total_bytes: int
    memory_free_bytes: int

    def to_json(self) -> GpuJson:
        return {"index": self.index, "name": self.name, "uuid": self.uuid,
                "memory_total_bytes": self.memory_total_bytes, "memory_free_bytes": self.memory_free_bytes}


class GpuProbe(Protocol):
    source: str  # "nvml", "simulated" or "none"
    note: str  # why there are no GPUs, or where simulated ones come from

    def gpus(self) -> list[Gpu]: ...


class NoGpus:
    source = "none"

    def __init__(self, note: str) -> None:
        self.note = note

    def gpus(self) -> list[Gpu]:
        return []


class NvmlProbe:
    """NVIDIA GPUs through NVML (the nvidia-ml-py package, the `[nvml]` extra)."""

    source = "nvml"
    note = ""

    def __init__(self) -> None:
        import pynvml  # raises ImportError where the extra is not installed

        pynvml.nvmlInit()  # raises NVMLError where there is no driver
        self._nvml = pynvml

    def gpus(self) -> list[Gpu]:
        nv = self._nvml
        out = []
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            name = nv.nvmlDeviceGetName(h)
            uuid = nv.nvmlDeviceGetUUID(h)
            out.append(Gpu(i, name.decode() if isinstance(name, bytes) else name,
                           uuid.decode() if isinstance(uuid, bytes) else uuid, int(mem.total), int(mem.free)))
        return out


class SimulatedGpus:
    """GPUs described in a JSON file, re-read on every request so a test can change free VRAM.
    For tests and benchmarks only: the state says `"simulated": true`."""

    source = "simulated"

    def __init__(self, path: Path) -> None:
        self.path = path
        self.note = f"simulated from {path}"
        self.gpus()  # fail at start, not at the first request

    def gpus(self) -> list[Gpu]:
        try:
            items = json.loads(self.path.read_text(encoding="utf-8"))
            return [Gpu(index=i, name=str(g["name"]), uuid=str(g.get("uuid", f"GPU-simulated-{i}")),
                        memory_total_bytes=int(g["memory_total_bytes"]),
                        memory_free_bytes=int(g.get("memory_free_bytes", g["memory_total_bytes"])))
                    for i, g in enumerate(items)]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"simulated GPU file {self.path}: {exc}; expected a JSON list of "
                             '{"name", "memory_total_bytes", "memory_free_bytes"?, "uuid"?}') from exc


def default_probe() -> GpuProbe:
    try:
        return NvmlProbe()
    except ImportError:
        return NoGpus("NVML bindings not installed (pip install 'fleet[nvml]')")
    except Exception as exc:  # pynvml.NVMLError and friends: no driver, no device
        return NoGpus(f"NVML unavailable: {exc}")


def measure(home: Path, probe: GpuProbe, *, reserve: int = 0) -> Inventory:
    """The machine now; `reserve`: the bytes of the home's disk that fetches leave free."""
    mem = psutil.virtual_memory()
    disk = shutil.disk_usage(home)
    gpus = probe.gpus()
    return {
        "cores": {"logical": os.cpu_count() or 0, "usable": len(os.sched_getaffinity(0))},
        "memory": {"total_bytes": mem.total, "available_bytes": mem.available},
        "disk": {"path": str(home), "total_bytes": disk.total, "free_bytes": disk.free, "reserve_bytes": reserve},
        "gpus": [g.to_json() for g in gpus],
        "gpu_source": probe.source,
        "gpu_note": probe.note,
        "simulated": probe.source == "simulated",
    }
