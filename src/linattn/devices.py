"""The one place a device name from a config or a command line becomes a `torch.device`."""
from __future__ import annotations

from typing import Optional, Type

import torch

from .errors import ConfigError, LinattnError


def resolve_device(name: Optional[str], error: Type[LinattnError] = ConfigError) -> torch.device:
    """`auto` (or None, ""): CUDA when available, else the CPU; otherwise the named device, which must be a
    torch device name, and CUDA must be available for a CUDA device. A bad name raises `error` (the caller's
    error class, so that each command reports it its own way), naming the device."""
    if name in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise error(f"unknown device {name!r} (auto, cpu, cuda, cuda:N, ...): {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise error(f"device {name!r} requested but CUDA is not available")
    return dev


__all__ = ["resolve_device"]
