"""Stored int8 / int4 weights dequantized to fp32 rows on a compiled kernel (`csrc/dequant.c`), for
`QuantizedLinear._dequantize_rows` (quant/linear.py).

`dequantize_rows(mode, qweight, scales, group, bf16_round)`: q * s for every weight in fp32, rounded once to bf16
with `bf16_round` (the bits of `dequantize(torch.bfloat16).float()`), exact without (those of
`dequantize(torch.float32)`). The torch formula stays the reference and the fallback (kernels off, no compiler,
under torch.compile tracing): `available()` says which runs. Nothing here imports linattn.quant.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..errors import LinattnError
from . import bindings, ptr, threads
from .build import enabled

__all__ = ["available", "dequantize_rows"]

#: weights per thread below which a call runs on fewer threads (about 0.1 ms of one thread's work)
GRAIN = 1 << 17
#: csrc/dequant.c's output forms: fp32 (exact, bf16-rounded), bf16
_FORMS = {torch.float32: (0, 1), torch.bfloat16: 2}


def available() -> bool:
    """True when the kernels are switched on and dequant.c builds (compiled once), eagerly."""
    if torch.compiler.is_compiling() or not enabled():
        return False
    return bindings.bind("dequant") is not None


def dequantize_rows(mode: str, qweight: torch.Tensor, scales: torch.Tensor, group: int, bf16_round: bool,
                    out: Optional[torch.Tensor] = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fp32 `[R, K]` q * s (rounded to bf16 with `bf16_round`) of int8 qweight `[R, K]` with bf16 scales `[R]`
    (mode "int8") or uint8 qweight `[R, K/2]` (two codes a byte, `pack_int4`) with bf16 scales `[R, K/group]`
    (mode "int4"); every tensor contiguous on the CPU (the layer's own buffers). dtype bf16: the same rounded values
    as bf16 (`dequantize(torch.bfloat16)`'s bits; bf16_round ignored). `out`: a contiguous buffer of dtype with at
    least R * K elements to write into (its first R * K, returned as `[R, K]`), so that a caller dequantizing block
    after block reuses one (a fresh 2 MiB buffer is a fresh mapping: page faults on every block)."""
    if mode not in ("int8", "int4"):
        raise LinattnError(f"dequantize_rows: mode must be 'int8' or 'int4', got {mode!r}")
    if mode == "int4" and (isinstance(group, bool) or not isinstance(group, int) or group <= 0 or group % 2):
        raise LinattnError(f"dequantize_rows: int4's group must be a positive even int, got {group!r}")
    R = qweight.shape[0] if qweight.dim() == 2 else -1
    K = qweight.shape[1] * (2 if mode == "int4" else 1) if qweight.dim() == 2 else -1
    want_q, want_s = (torch.int8, [R]) if mode == "int8" else (torch.uint8, [R, K // group])
    if (qweight.dim() != 2 or qweight.dtype != want_q or scales.dtype != torch.bfloat16
            or list(scales.shape) != want_s or (mode == "int4" and K % group)):
        k = "K/2" if mode == "int4" else "K"
        s = "[R]" if mode == "int8" else "[R, K/group] (K a multiple of group)"
        raise LinattnError(f"dequantize_rows ({mode}): qweight must be {want_q} [R, {k}] and scales bf16 {s}; got "
                           f"qweight {qweight.dtype} {list(qweight.shape)}, scales {scales.dtype} "
                           f"{list(scales.shape)}")
    for name, t in (("qweight", qweight), ("scales", scales)):
        if t.device.type != "cpu" or not t.is_contiguous():
            raise LinattnError(f"dequantize_rows: {name} must be a contiguous CPU tensor")
    if dtype not in _FORMS:
        raise LinattnError(f"dequantize_rows: dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    if out is None:
        out = torch.empty(R, K, dtype=dtype)
    elif out.dtype != dtype or not out.is_contiguous() or out.device.type != "cpu" or out.numel() < R * K:
        raise LinattnError(f"dequantize_rows: out must be a contiguous {dtype} CPU buffer of at least {R * K} "
                           f"elements, got {out.dtype} {list(out.shape)}")
    else:
        out = out.view(-1)[:R * K].view(R, K)
    if R == 0 or K == 0:
        return out
    form = _FORMS[dtype] if dtype == torch.bfloat16 else _FORMS[dtype][bool(bf16_round)]
    n = threads(R * K, GRAIN)
    lib = bindings.require("dequant")
    if mode == "int8":
        lib("linattn_dequant_int8", None, R, K, ptr(qweight), ptr(scales), form, ptr(out), n)
    else:
        lib("linattn_dequant_int4", None, R, K, group, ptr(qweight), ptr(scales), form, ptr(out), n)
    return out
