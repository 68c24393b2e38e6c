"""Checks of the machine the agent runs on: writable directories and the engines' build variant."""

from __future__ import annotations

import functools
import os
import pwd
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Literal


@dataclass(frozen=True, slots=True)
class Finding:
    level: Literal["ok", "warning", "error"]
    check: str
    message: str
    install: str = ""  # a build mismatch: the package to install instead (reported in the agent's state)


def user_name() -> str:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return f"uid {os.geteuid()}"


def cache_dirs(env: dict[str, str] | None = None) -> dict[str, Path]:
    """Directories the engines write on first model load, as they resolve them."""
    env = dict(os.environ) if env is None else env
    cache = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return {
        "HF_HOME": Path(env.get("HF_HOME") or cache / "huggingface"),
        "TORCH_HOME": Path(env.get("TORCH_HOME") or cache / "torch"),
        "LLAMA_CACHE": Path(env.get("LLAMA_CACHE") or cache / "llama.cpp"),
    }


def writable(path: Path) -> str | None:
    """None when `path` (or, if it does not exist yet, the directory that would hold it) accepts a
    new file; otherwise the reason. It tries for real: permission bits lie on read-only mounts."""
    target = path
    while not target.exists():
        if target.parent == target:
            return "no existing parent directory"
        target = target.parent
    if not target.is_dir():
        return f"{target} is not a directory"
    try:
        with tempfile.NamedTemporaryFile(dir=target, prefix=".fleet-write-check-"):
            pass
    except OSError as exc:
        where = "" if target == path else f" (it does not exist, and its parent {target} is not writable)"
        return f"{exc.strerror or exc}{where}"
    return None


def directory_findings(home: Path, env: dict[str, str] | None = None) -> list[Finding]:
    user = user_name()
    out = []
    for label, path in [("home", home), *cache_dirs(env).items()]:
        reason = writable(path)
        if reason is None:
            out.append(Finding("ok", f"writable:{label}", f"{label} {path} is writable by {user}"))
        else:
            out.append(Finding("error", f"writable:{label}", f"{label} {path} is not writable by user {user}: {reason}"))
    return out


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def engines() -> dict[str, Any]:
    """The engine packages installed, read from their metadata (importing torch takes seconds)."""
    torch_version = _dist_version("torch")
    torch = None
    if torch_version is not None:
        local = torch_version.partition("+")[2]
        if local.startswith("cu"):
            build = "cuda"
        elif local.startswith("rocm"):
            build = "rocm"
        elif local == "cpu":
            build = "cpu"
        else:  # PyPI's Linux wheels carry no label; the CUDA ones pull the nvidia-* runtime packages
            has_cuda = any((d.metadata["Name"] or "").lower().startswith("nvidia-cuda-runtime")
                           for d in metadata.distributions())
            build = "cuda" if has_cuda else "cpu"
        torch = {"version": torch_version, "build": build}
    return {
        "torch": torch,
        "transformers": _dist_version("transformers"),
        "llama_cpp": _dist_version("llama-cpp-python"),
    }


# What to install where the build does not match the machine's GPUs.
INSTALL = {"torch": "a CUDA build of torch (pip install torch --index-url https://download.pytorch.org/whl/cu128)",
           "torch_cpu": "the CPU build of torch (pip install torch --index-url https://download.pytorch.org/whl/cpu)",
           "llama_cpp": 'llama-cpp-python built with CUDA (CMAKE_ARGS="-DGGML_CUDA=on" pip install '
                        "--force-reinstall --no-cache-dir llama-cpp-python)"}


def variant(eng: dict[str, Any]) -> str:
    torch = eng.get("torch")
    return torch["build"] if torch else "cpu"


def variant_findings(gpu_count: int, gpu_note: str, eng: dict[str, Any],
                     llama_gpu_offload: bool | None = None) -> list[Finding]:
    """The mismatches that make a server silently slow or fail late, reported at once."""
    out: list[Finding] = []
    torch = eng.get("torch")
    if torch is None:
        out.append(Finding("warning", "variant:torch",
                           "torch is not installed: this node cannot serve safetensors models "
                           "(pip install 'inference-fleet[torch]')"))
    elif gpu_count and torch["build"] != "cuda":
        out.append(Finding("error", "variant:torch",
                           f"{gpu_count} NVIDIA GPU(s) present but torch {torch['version']} is a "
                           f"{torch['build']} build: servers would run on the CPU. Install a CUDA build of "
                           "torch matching the driver (e.g. torch==2.13.0+cu128 from PyTorch's CUDA wheel index).",
                           INSTALL["torch"]))
    elif not gpu_count and torch["build"] == "cuda":
        out.append(Finding("warning", "variant:torch",
                           f"torch {torch['version']} is a CUDA build but no NVIDIA GPU is visible "
                           f"({gpu_note or 'NVML reports none'}): servers will run on the CPU. The CPU build "
                           "(torch==X+cpu) is several GB smaller.", INSTALL["torch_cpu"]))
    else:
        out.append(Finding("ok", "variant:torch", f"torch {torch['version']} ({torch['build']} build) "
                                                  f"matches {gpu_count} GPU(s)"))
    if eng.get("llama_cpp") is None:
        out.append(Finding("warning", "variant:llama_cpp",
                           "llama-cpp-python is not installed: this node cannot serve GGUF models "
                           "(pip install 'inference-fleet[gguf]')"))
    elif gpu_count and llama_gpu_offload is False:
        out.append(Finding("error", "variant:llama_cpp",
                           f"{gpu_count} NVIDIA GPU(s) present but llama-cpp-python {eng['llama_cpp']} was built "
                           "without GPU offload. Reinstall it with CMAKE_ARGS=\"-DGGML_CUDA=on\" "
                           "pip install --force-reinstall --no-cache-dir llama-cpp-python", INSTALL["llama_cpp"]))
    else:
        out.append(Finding("ok", "variant:llama_cpp", f"llama-cpp-python {eng['llama_cpp']}"))
    return out


def llama_gpu_backend(root: Path | None = None) -> bool | None:
    """Whether the installed llama.cpp library was built with a GPU backend, read from the shared
    libraries its wheel ships (loading the library to ask it costs the agent's memory and a second):
    None where llama-cpp-python is not installed or ships its libraries elsewhere."""
    if root is None:
        try:
            files = metadata.files("llama-cpp-python") or []
        except metadata.PackageNotFoundError:
            return None
        names = [Path(str(f)).name for f in files if "/lib/" in str(f) and ".so" in str(f)]
    else:
        names = [p.name for p in root.iterdir()]
    if not any(n.startswith(("libllama", "libggml")) for n in names):
        return None
    return any(n.startswith(GPU_LIBS) for n in names)


GPU_LIBS = ("libggml-cuda", "libggml-hip", "libggml-vulkan", "libggml-metal", "libggml-sycl")


def state_findings(gpu_count: int, gpu_note: str, eng: dict[str, Any]) -> list[dict[str, str]]:
    """The build mismatches the agent reports in its state (variant.findings), each with the
    package to install: what the planner warns about and `fleet nodes --wide` shows, at once."""
    llama = _llama_gpu_backend() if gpu_count and eng.get("llama_cpp") else None
    return [{"check": f.check, "level": f.level, "message": f.message, "install": f.install}
            for f in variant_findings(gpu_count, gpu_note, eng, llama) if f.install]


@functools.cache
def _llama_gpu_backend() -> bool | None:
    return llama_gpu_backend()  # the installed library does not change while the agent runs


def llama_gpu_offload() -> bool | None:
    """Whether the installed llama.cpp library can offload to a GPU (loads the library: doctor only)."""
    try:
        import llama_cpp

        return bool(llama_cpp.llama_supports_gpu_offload())
    except Exception:
        return None
