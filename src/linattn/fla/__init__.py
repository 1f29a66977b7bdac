"""The `backend="fla"` adapters: linattn's operators over flash-linear-attention's (fla-core's) GPU kernels.

Importing this package does NOT import fla: `linattn` installs and runs without it. The adapters
(`linattn.fla.linear`, `linattn.fla.delta`) look fla's functions up when they are called
(`kernel(module, name)`), and the dispatch (`linattn.ops.backend`) calls them only once it has chosen
this backend. Like `linattn.triton`, nothing here imports `linattn.ops`: the adapters take tensors
already validated (and, for linear attention, already mapped through the feature map) and translate
linattn's conventions into fla's arguments around one kernel call.

    linattn.fla.linear.linear_attention   linear_attention: chunk_simple_gla / chunk_gla, fused_recurrent_* twins
    linattn.fla.delta.delta_rule          delta_rule: chunk_delta_rule / chunk_gated_delta_rule / chunk_kda,
                                          fused_recurrent_gated_delta_rule / fused_recurrent_kda
    linattn.fla.delta.rwkv7               rwkv7: chunk_rwkv7 / fused_recurrent_rwkv7
    linattn.fla.attention.forgetting_attention   forgetting_attention: parallel_forgetting_attn
    linattn.fla.attention.path_attention  path_attention: parallel_path_attn

`unavailable()` says why fla cannot be used here (not installed, an untested version, a broken install),
`runs_on(device)` whether its kernels run on a device (CUDA only: they are Triton kernels), and `DTYPES`
the input dtypes they take. The tests replace `runs_on`, `DTYPES` and the fla functions themselves with
stand-ins to run every translation on the CPU (tests/fla/).
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import Callable, Optional

import torch

__all__ = ["TESTED_VERSION", "INSTALL_HINT", "DTYPES", "MAX_HEAD_DIM", "unavailable", "runs_on", "kernel"]

#: the fla-core release these adapters were written and tested against (pinned by the `gpu` extra)
TESTED_VERSION = "0.6.0"
INSTALL_HINT = 'pip install "linattn[gpu]"'
#: the input dtypes fla's kernels take (they compute in fp32 inside; fp64 has no kernel)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: fla's delta-rule and KDA kernels keep a whole key head in registers and assert K <= 256
MAX_HEAD_DIM = 256

_UNAVAILABLE: Optional[list] = None


def _installed_version() -> Optional[str]:
    from importlib import metadata

    for dist in ("fla-core", "flash-linear-attention"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def unavailable() -> Optional[str]:
    """Why the fla backend cannot be used in this environment (None when it can): fla-core is not installed,
    its version is not the tested one, or `fla.ops` fails to import. Checked once, on the first call (which
    imports fla); nothing is imported before."""
    global _UNAVAILABLE
    if _UNAVAILABLE is None:
        _UNAVAILABLE = [_check()]
    return _UNAVAILABLE[0]


def _check() -> Optional[str]:
    if importlib.util.find_spec("fla") is None:
        return f"fla-core is not installed ({INSTALL_HINT})"
    version = _installed_version()
    if version != TESTED_VERSION:
        return (f"fla-core {version} is installed, but linattn's fla adapters are tested with {TESTED_VERSION} "
                f"only ({INSTALL_HINT} installs it)")
    try:
        importlib.import_module("fla.ops")
    except Exception as e:  # a broken install counts as absent, with its reason
        return f"fla-core {version} fails to import ({type(e).__name__}: {e}); reinstall with {INSTALL_HINT}"
    return None


def runs_on(device: torch.device) -> bool:
    """Whether fla's kernels run on `device`: CUDA (and ROCm, which torch also calls "cuda") only."""
    return device.type == "cuda"


def kernel(module: str, name: str) -> Callable:
    """fla's function `name` of `module` (e.g. "fla.ops.gla", "chunk_gla"), looked up at each call so that a
    replaced module attribute (the tests' stand-ins) is what runs."""
    return getattr(importlib.import_module(module), name)
