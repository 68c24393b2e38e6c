"""What the machine has, measured at the time of asking: cores, memory, disk, GPUs (NVML)."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

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
        """The GPUs NVML answers for now. One that fails to answer (fallen off the bus, reset: NVML
        errors such as GPU_IS_LOST) is left out and named in `note`, as a GPU the node does not have
        now; a count that fails leaves none. Never raises: the state is asked on every heartbeat."""
        nv = self._nvml
        out, lost = [], []
        try:
            count = int(nv.nvmlDeviceGetCount())
        except nv.NVMLError as exc:
            # The driver reloaded (or was unloaded) under this process: NVML answers Uninitialized
            # until it is shut down and initialised again: tried once in a read that fails, never otherwise.
            try:
                try:
                    nv.nvmlShutdown()
                except nv.NVMLError:
                    pass
                nv.nvmlInit()
                count = int(nv.nvmlDeviceGetCount())
            except nv.NVMLError as again:
                self.note = f"NVML could not count the GPUs: {exc}" + (
                    f"; initialising it again: {again}" if str(again) != str(exc) else "")
                return []
        for i in range(count):
            try:
                h = nv.nvmlDeviceGetHandleByIndex(i)
                mem = nv.nvmlDeviceGetMemoryInfo(h)
                name = nv.nvmlDeviceGetName(h)
                uuid = nv.nvmlDeviceGetUUID(h)
            except nv.NVMLError as exc:
                lost.append(f"GPU {i}: {exc}")
                continue
            out.append(Gpu(i, name.decode() if isinstance(name, bytes) else name,
                           uuid.decode() if isinstance(uuid, bytes) else uuid, int(mem.total), int(mem.free)))
        self.note = f"left out, NVML did not answer for them: {'; '.join(lost)}" if lost else ""
        return out


class SimulatedGpus:
    """GPUs described in a JSON file, re-read on every request so a test can change free VRAM.
    For tests and benchmarks only: the state says `"simulated": true`.

    They behave as NVML would: the file's free memory stands for what processes that are not
    fleet's leave, and what this agent's own servers reserve on a GPU (`loaded`: uuid -> bytes,
    wired to Workers.reserved by the agent) is taken off it as a loaded server's memory would be,
    never below 0. A GPU removed from the file is gone from the next answer."""

    source = "simulated"

    def __init__(self, path: Path, loaded: Callable[[], Mapping[str, int]] | None = None) -> None:
        self.path = path
        self.note = f"simulated from {path}"
        self.loaded = loaded
        self.gpus()  # fail at start, not at the first request

    def gpus(self) -> list[Gpu]:
        try:
            items = json.loads(self.path.read_text(encoding="utf-8"))
            found = [Gpu(index=int(g.get("index", i)), name=str(g["name"]),
                         uuid=str(g.get("uuid", f"GPU-simulated-{i}")),
                         memory_total_bytes=int(g["memory_total_bytes"]),
                         memory_free_bytes=int(g.get("memory_free_bytes", g["memory_total_bytes"])))
                     for i, g in enumerate(items)]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"simulated GPU file {self.path}: {exc}; expected a JSON list of "
                             '{"name", "memory_total_bytes", "memory_free_bytes"?, "uuid"?, "index"?}') from exc
        held = self.loaded() if self.loaded is not None else {}
        return [Gpu(g.index, g.name, g.uuid, g.memory_total_bytes, max(0, g.memory_free_bytes - held.get(g.uuid, 0)))
                for g in found]


def default_probe() -> GpuProbe:
    try:
        return NvmlProbe()
    except ImportError:
        return NoGpus("NVML bindings not installed (pip install 'inference-fleet[nvml]')")
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
