"""What a measurement ran on: the CPU's name, a one-line machine description, library versions."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch
import transformers

VERSION = "0.1.0"


def cpu_name() -> str:
    """The CPU model from ``/proc/cpuinfo`` (or what ``platform`` knows elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_description(threads: int) -> str:
    """One line naming the machine the numbers came from: cores, CPU model, torch version and device, threads."""
    device = f"CUDA ({torch.cuda.get_device_name()})" if torch.cuda.is_available() else "CPU"
    version = torch.__version__.split("+")[0]
    plural = "" if threads == 1 else "s"
    return f"{os.cpu_count() or 0}-core {cpu_name()}, torch {version} {device}, {threads} thread{plural}"


def versions() -> dict[str, str]:
    """Versions of kvcompress, torch, transformers and Python."""
    return {
        "kvcompress": VERSION,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
