"""The fused single-token decoding step on compiled CPU kernels (`csrc/decode.c`).

A decoding step of a delta-rule layer (DeltaNet, Gated DeltaNet, EFLA) or of linear attention with a
linear-space elementwise feature map is three calls: the fused q/k/v/gate projection (one BLAS matrix-vector
product, in the layer), one compiled call for everything between (short convolution, normalisations, beta,
decay, state update, read-out, output RMSNorm and SiLU gate), and o_proj. The layers' PyTorch fast step
(`layers/base.py`) stays the fallback and the reference (tests/cpu/test_decode.py).

Entry points take the fused projection output y `[B, ldy]` and return fresh tensors (output, new state, new
conv window): nothing is written in place, so a cache that shares buffers with a copy stays correct.
Grad-free use only (the layers call it under `torch.no_grad` decoding). Nothing here imports linattn.ops.
"""
from __future__ import annotations

import ctypes
import os
from typing import Optional, Tuple

import torch

from . import c_double, c_i64, c_int, c_ptr, load_library, ptr, threads
from .build import ENV_SWITCH, enabled

__all__ = ["available", "delta_step", "linear_step", "BlockPlan", "block_step", "ModelPlan", "model_function",
           "BETA_MODES", "FEATURE_MAPS"]

#: the feature maps the linear step computes (the C codes)
from ..feature_codes import FUSED_MAPS as FEATURE_MAPS  # noqa: E402, I001 (one table, every path)
#: EFLA's beta modes in the order of their C codes (beta_mode 0, 1, 2)
BETA_MODES = ("sigmoid", "adaptive", "loose")
_typed = set()
_SFX = {torch.float32: "f32", torch.float64: "f64"}


def _library():
    if not enabled():
        return None
    lib = load_library("decode")
    if lib is not None and id(lib) not in _typed:
        for sfx in ("f32", "f64"):
            f = getattr(lib, f"linattn_decode_delta_{sfx}")
            f.argtypes = ([c_i64] * 5 + [c_ptr, c_i64, c_i64] + [c_ptr] * 3 + [c_int, c_ptr]
                          + [c_int] * 3 + [c_double] * 2 + [c_int, c_ptr, c_int] + [c_ptr] * 4
                          + [c_int, c_ptr, c_double, c_int, c_ptr, c_int])
            f.restype = c_int
            g = getattr(lib, f"linattn_decode_linear_{sfx}")
            g.argtypes = ([c_i64] * 5 + [c_ptr, c_i64, c_i64] + [c_ptr] * 3 + [c_int, c_ptr]
                          + [c_int, c_double, c_int] + [c_ptr] * 5 + [c_int, c_int, c_double]
                          + [c_int, c_ptr, c_double, c_int, c_ptr, c_int])
            g.restype = c_int
            f = getattr(lib, f"linattn_decode_block_{sfx}")
            f.argtypes = [ctypes.POINTER(BlockPlan)] + [c_ptr] * 6
            f.restype = c_int
            f = getattr(lib, f"linattn_decode_model_{sfx}")
            f.argtypes = [ctypes.POINTER(ModelPlan)] + [c_ptr] * 7
            f.restype = c_int
        _typed.add(id(lib))
    return lib


# the switch is read on every decoded token, where os.environ.get (key encoding, value decoding, normalising: ~50
# us when its code and data are out of cache, as between other models' steps) cost more than the check is worth:
# `switched_on` looks the raw value up in os.environ's own mapping and keeps the decision while it is the same
# object (setting or deleting the variable stores a new one or none)
_ENV_KEY = os.environ.encodekey(ENV_SWITCH) if hasattr(os.environ, "encodekey") else None
_switch_seen: tuple = (object(), True)


def switched_on() -> bool:
    """`build.enabled()` (LINATTN_CPU_KERNELS not 0 / false / off / no), cheap enough for every decoded token."""
    global _switch_seen
    data = getattr(os.environ, "_data", None)
    if type(data) is not dict or _ENV_KEY is None:
        return enabled()
    raw = data.get(_ENV_KEY)
    if raw is None:
        return True
    seen = _switch_seen
    if raw is not seen[0]:
        seen = _switch_seen = (raw, enabled())
    return seen[1]


def available() -> bool:
    """True when the kernels are switched on (LINATTN_CPU_KERNELS) and decode.c builds (compiles it once);
    False under torch.compile tracing (the decoding step is an eager, grad-free path)."""
    if torch.compiler.is_compiling():
        return False
    return _library() is not None


def _conv_args(conv, B: int, C: int, dtype: torch.dtype):
    """(KC, w_in, cw, cb, act, w_out) for the kernel; conv = (window [B, C, KC-1] or None, weight [C, KC], bias
    [C] or None, silu: bool) or None (no short convolution)."""
    if conv is None:
        return 0, None, None, None, 0, None
    w_in, cw, cb, act = conv
    KC = cw.shape[-1]
    w_out = torch.empty(B, C, KC - 1, dtype=dtype)
    return KC, w_in, cw, cb, int(bool(act)), w_out


def _check(rc: int) -> None:
    if rc:
        raise MemoryError("linattn: the compiled decoding step could not allocate its work buffer")


def delta_step(y: torch.Tensor, *, heads: Tuple[int, int, int, int], conv, kind: int, l2conv: int, q_l2: bool,
               l2eps: float, scale: float, beta_mode: int, alpha: Optional[torch.Tensor], gated: bool,
               neg_a: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], S: Optional[torch.Tensor],
               norm: Tuple[bool, Optional[torch.Tensor], float], has_gate: bool):
    """One token of a delta-rule layer (csrc/decode.c, linattn_decode_delta): y `[B, ldy]` the fused
    projection; heads (H, HV, K, V); returns (o `[B, HV * V]` normed and gated, S `[B, HV, K, V]`, conv window
    `[B, C, KC-1]` or None). Every tensor contiguous, in y's dtype (float32 or float64)."""
    lib = _library()
    H, HV, K, V = heads
    B, ldy = y.shape
    C = 2 * H * K + HV * V
    KC, w_in, cw, cb, act, w_out = _conv_args(conv, B, C, y.dtype)
    S_out = torch.empty(B, HV, K, V, dtype=y.dtype)
    out = torch.empty(B, HV * V, dtype=y.dtype)
    has_norm, nw, neps = norm
    _check(getattr(lib, f"linattn_decode_delta_{_SFX[y.dtype]}")(
        B, H, HV, K, V, ptr(y), ldy, KC, ptr(w_in), ptr(cw), ptr(cb), act, ptr(w_out),
        kind, l2conv, int(q_l2), l2eps, scale, beta_mode, ptr(alpha), int(gated), ptr(neg_a), ptr(dt_bias),
        ptr(S), ptr(S_out), int(has_norm), ptr(nw), neps, int(has_gate), ptr(out), threads()))
    return out, S_out, w_out


def linear_step(y: torch.Tensor, *, heads: Tuple[int, int, int, int], conv, fmap: int, scale: float,
                gate_kind: int, decay: Optional[torch.Tensor], neg_a: Optional[torch.Tensor],
                dt_bias: Optional[torch.Tensor], S: Optional[torch.Tensor], normalize: bool, nonneg: bool,
                eps: float, norm: Tuple[bool, Optional[torch.Tensor], float], has_gate: bool):
    """One token of linear attention (csrc/decode.c, linattn_decode_linear): the state [kv | z] as one
    `[B, HV, K, V + 1]`; returns (o `[B, HV * V]`, S, conv window or None) as `delta_step`."""
    lib = _library()
    H, HV, K, V = heads
    B, ldy = y.shape
    C = 2 * H * K + HV * V
    KC, w_in, cw, cb, act, w_out = _conv_args(conv, B, C, y.dtype)
    S_out = torch.empty(B, HV, K, V + 1, dtype=y.dtype)
    out = torch.empty(B, HV * V, dtype=y.dtype)
    has_norm, nw, neps = norm
    _check(getattr(lib, f"linattn_decode_linear_{_SFX[y.dtype]}")(
        B, H, HV, K, V, ptr(y), ldy, KC, ptr(w_in), ptr(cw), ptr(cb), act, ptr(w_out),
        fmap, scale, gate_kind, ptr(decay), ptr(neg_a), ptr(dt_bias), ptr(S), ptr(S_out),
        int(normalize), int(nonneg), eps, int(has_norm), ptr(nw), neps, int(has_gate), ptr(out), threads()))
    return out, S_out, w_out


class BlockPlan(ctypes.Structure):
    """`linattn_block_plan` of csrc/decode.c: what a whole-block decoding step (`block_step`) needs besides the
    token and the state, fixed while the layer's parameters are. Pointer fields are data addresses (0: NULL);
    `keep` holds the tensors they point into (set by the builder, models/decode_plan.py). `wbf16` (float32 plans):
    the matrices W, Wo, Wgu and Wd are stored as bfloat16, read with fp32 accumulation."""

    _fields_ = ([(n, ctypes.c_int64) for n in ("B", "H", "HV", "K", "V", "d", "ny", "KC", "hid")]
                + [(n, ctypes.c_int32) for n in ("kind", "conv_act", "dkind", "l2conv", "q_l2", "beta_mode", "gated",
                                                 "fmap", "gate_kind", "normalize", "nonneg", "has_norm", "has_gate",
                                                 "has_ffn", "nthreads", "wbf16")]
                + [(n, ctypes.c_double) for n in ("l2eps", "scale", "eps", "norm_eps", "n1eps", "n2eps")]
                + [(n, ctypes.c_void_p) for n in ("n1w", "W", "Wb", "cw", "cb", "alpha", "neg_a", "dt_bias", "decay",
                                                  "nw", "Wo", "n2w", "Wgu", "bgu", "Wd", "bd")])


def block_step(plan: BlockPlan, fn, x: torch.Tensor, w_in: Optional[torch.Tensor], S_in: Optional[torch.Tensor],
               w_out: Optional[torch.Tensor], S_out: torch.Tensor, x_out: torch.Tensor) -> None:
    """One token through a whole pre-norm block (csrc/decode.c, linattn_decode_block): x `[B, d]` -> x_out; the
    mixer's conv window w_in -> w_out and state S_in -> S_out (fresh buffers; w_in and S_in None before the first
    token). fn: `block_function(dtype)`. Every buffer contiguous in the plan's dtype."""
    _check(fn(ctypes.byref(plan), x.data_ptr(), None if w_in is None else w_in.data_ptr(),
              None if S_in is None else S_in.data_ptr(), None if w_out is None else w_out.data_ptr(),
              S_out.data_ptr(), x_out.data_ptr()))


def block_function(dtype: torch.dtype):
    """The compiled whole-block step for dtype (float32 / float64), or None when the kernels are off or absent."""
    lib = _library()
    return None if lib is None else getattr(lib, f"linattn_decode_block_{_SFX[dtype]}")


class ModelPlan(ctypes.Structure):
    """`linattn_model_plan` of csrc/decode.c: a whole model's decoding step (`linattn_decode_model`): the embedding,
    L block plans, the final RMSNorm and the head, and where each layer's state and conv window sit in the
    step's state / window buffers. Built in models/decode_plan.py (`model_step`), which keeps what it points into.
    `wbf16` (float32 plans): the embedding and head are bfloat16 too, and the logits are written as bfloat16."""

    _fields_ = ([(n, ctypes.c_int64) for n in ("L", "B", "d", "vocab")]
                + [(n, ctypes.c_int32) for n in ("has_norm", "nthreads", "wbf16", "pad_")]
                + [("norm_eps", ctypes.c_double)]
                + [(n, ctypes.c_void_p) for n in ("embed", "norm_w", "head", "blocks", "s_off", "w_off")])


def model_function(dtype: torch.dtype):
    """The compiled whole-model step for dtype (float32 / float64, the compute dtype: a bf16 plan is float32):
    fn(byref(plan), ids, S_in, w_in, S_out, w_out, logits, aux) -> 0, 1 (out of memory) or 2 (a token id out of
    range; nothing written); aux (a float32 scalar, or None) is set to 0 on success; None when the kernels are off
    or absent."""
    lib = _library()
    return None if lib is None else getattr(lib, f"linattn_decode_model_{_SFX[dtype]}")
