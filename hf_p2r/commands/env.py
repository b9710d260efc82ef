"""`hf-p2r env`: the versions and hardware a bug report needs, like `transformers env` and `accelerate env`.

Paste its output into an issue. It reads package versions from their metadata and asks torch about CUDA; it prints no
environment variable, path or token.
"""

import argparse
import os
import platform

from ..train import malloc_policy
from . import add_command

HELP = "print versions, CUDA devices and CPUs for a bug report"
DESCRIPTION = (
    "Print hf-p2r's, Python's and the main libraries' versions, the platform, CUDA (availability, "
    "version, devices) and the number of CPUs, to paste into a bug report. Prints no token or environment "
    "variable."
)
PACKAGES = ("torch", "transformers", "accelerate", "datasets", "safetensors", "huggingface_hub", "deepspeed")


def register(subparsers: argparse._SubParsersAction) -> None:
    add_command(subparsers, "env", HELP, DESCRIPTION, run)


def run(args: argparse.Namespace) -> int:
    print("Copy and paste the text below into your issue.\n")
    print("\n".join(f"- {key}: {value}" for key, value in collect().items()))
    return 0


def collect() -> dict[str, str]:
    """{what: value} for a bug report."""
    info = {"hf-p2r version": _version("hf-p2r"), "Python version": platform.python_version()}
    info["Platform"] = platform.platform()
    for package in PACKAGES:
        info[f"{package} version"] = _version(package)
    info.update(_cuda())
    info["Trainer's malloc"] = malloc_policy()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    info["CPUs"] = f"{os.cpu_count()}" + (f" ({usable} usable by this process)" if usable != os.cpu_count() else "")
    return info


def _version(package: str) -> str:
    import importlib.metadata  # (here: every hf-p2r command imports this module, and it costs 0.03 s)

    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _cuda() -> dict[str, str]:
    try:
        import torch
    except ImportError:
        return {"CUDA available": "unknown (torch not installed)"}
    if not torch.cuda.is_available():
        return {"CUDA available": "False", "CUDA version (torch built with)": str(torch.version.cuda)}
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "CUDA available": "True",
        "CUDA version (torch built with)": str(torch.version.cuda),
        "CUDA devices": str(len(names)),
        "CUDA device names": ", ".join(names),
    }
