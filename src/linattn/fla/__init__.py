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
`runs_on(device)` whether its kernels run on a device (CUDA only: they are Triton kernels), `DTYPES`
the input dtypes they take, and `gated_backward_refused()` why fla-core would refuse a gated chunk kernel's
backward on this machine (Hopper with Triton >= 3.4, < 3.7.1: fla-core raises inside the backward pass, so the
dispatch must know before the forward). The tests replace `runs_on`, `DTYPES` and the fla functions themselves with
stand-ins to run every translation on the CPU (tests/fla/).
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Callable, Optional

import torch

__all__ = ["TESTED_VERSION", "INSTALL_HINT", "DTYPES", "MAX_HEAD_DIM", "GATED_BACKWARD_KERNELS", "unavailable",
           "runs_on", "kernel", "gated_backward_refused"]

#: the fla-core release these adapters were written and tested against (pinned by the `gpu` extra)
TESTED_VERSION = "0.6.0"
INSTALL_HINT = 'pip install "linattn[gpu]"'
#: the input dtypes fla's kernels take (they compute in fp32 inside; fp64 has no kernel)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: fla's delta-rule and KDA kernels keep a whole key head in registers and assert K <= 256
MAX_HEAD_DIM = 256

#: fla's chunk kernels whose backward runs fla's `chunk_bwd_dqkwg` with a gate tensor (chunk_simple_gla only with
#: `g`, not `g_gamma`): the call fla-core refuses on Hopper GPUs with Triton >= 3.4, < 3.7.1 (its issue #640)
GATED_BACKWARD_KERNELS = ("chunk_simple_gla", "chunk_gated_delta_rule")

_UNAVAILABLE: Optional[list] = None
_GATED_BACKWARD: Optional[list] = None


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


def gated_backward_refused() -> Optional[str]:
    """Why fla-core would refuse the backward of its gated chunk kernels here (`GATED_BACKWARD_KERNELS`), None
    when it would not (or fla is unavailable: the dispatch says that first). fla-core 0.6.0 raises a RuntimeError
    from inside the backward pass on Hopper GPUs with Triton >= 3.4.0, < 3.7.1 (wrong results there, its issue
    #640) unless its tilelang backend takes the call; read from fla's own flags and backend class, once."""
    global _GATED_BACKWARD
    if _GATED_BACKWARD is None:
        _GATED_BACKWARD = [_gated_backward_check()]
    return _GATED_BACKWARD[0]


def _gated_backward_check() -> Optional[str]:
    if unavailable() is not None:
        return None
    utils = importlib.import_module("fla.utils")
    hopper, above_340, above_371 = (bool(getattr(utils, name, False))
                                    for name in ("IS_NVIDIA_HOPPER", "TRITON_ABOVE_3_4_0", "TRITON_ABOVE_3_7_1"))
    if not (hopper and above_340 and not above_371):
        return None
    dispatch_off = os.environ.get("FLA_DISABLE_BACKEND_DISPATCH") == "1"   # (fla.backends reads it so)
    tilelang = importlib.import_module("fla.ops.common.backends.tilelang").CommonTileLangBackend
    if not dispatch_off and tilelang.can_use():
        return None
    triton = importlib.util.find_spec("triton") and importlib.import_module("triton")
    version = getattr(triton, "__version__", "?")
    return (f"fla-core {TESTED_VERSION} refuses the backward of its gated chunk kernels on Hopper GPUs with Triton "
            f"{version} (>= 3.4.0, < 3.7.1: wrong results, fla issue #640); Triton >= 3.7.1 or tilelang "
            f"(pip install tilelang) lifts it")
