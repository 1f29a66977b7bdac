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
import time
from typing import Optional, Tuple

import torch

from ..errors import LinattnError
from . import bindings, ptr, threads
from .abi import FUSED_PRODUCTS, KDA_MATRICES, PLAN_PARTS, WEIGHT_MATRICES, BlockPlan, ModelPlan
from .build import ENV_SWITCH, enabled
from .qlayout import step_scales

__all__ = ["available", "delta_step", "linear_step", "BlockPlan", "block_step", "ModelPlan", "model_function",
           "greedy_function", "BETA_MODES", "FEATURE_MAPS", "FUSED_PRODUCTS", "KDA_MATRICES", "PLAN_PARTS",
           "WEIGHT_FORMATS", "WEIGHT_MATRICES", "weight_matvec", "SECTIONS", "TIMING_SWITCH", "section_times",
           "timing_library"]

#: the feature maps the linear step computes (the C codes)
from ..feature_codes import FUSED_MAPS as FEATURE_MAPS  # noqa: E402, I001 (one table, every path)
#: the delta step's beta modes in the order of their C codes (beta_mode 0, 1, 2: EFLA's; 3 "doubled": 2 sigmoid,
#: negative eigenvalues allowed, as OLMo-hybrid's Gated DeltaNet)
BETA_MODES = ("sigmoid", "adaptive", "loose", "doubled")
#: the weight formats of the plans' matrices (csrc/qmatvec.h WF_*: `fmt_<matrix>` fields, 0 = as `wbf16` says)
WEIGHT_FORMATS = {"plan": 0, "bf16": 1, "int8": 2, "int4": 3,
                  "int8_a8": 4, "int4_a8": 5}   # (int8 / int4 weights, x rounded to int8 per block of 32)


def _library() -> Optional[bindings.Bound]:
    """decode.c bound from its table (cpu/abi.py), or None when the kernels are off or cannot be built."""
    return bindings.bind("decode") if enabled() else None


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
    _check(lib.function("linattn_decode_delta", y.dtype)(
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
    _check(lib.function("linattn_decode_linear", y.dtype)(
        B, H, HV, K, V, ptr(y), ldy, KC, ptr(w_in), ptr(cw), ptr(cb), act, ptr(w_out),
        fmap, scale, gate_kind, ptr(decay), ptr(neg_a), ptr(dt_bias), ptr(S), ptr(S_out),
        int(normalize), int(nonneg), eps, int(has_norm), ptr(nw), neps, int(has_gate), ptr(out), threads()))
    return out, S_out, w_out


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
    return None if lib is None else lib.function("linattn_decode_block", dtype)


def model_function(dtype: torch.dtype):
    """The compiled whole-model step for dtype (float32 / float64, the compute dtype: a bf16 plan is float32):
    fn(byref(plan), ids, S_in, w_in, S_out, w_out, logits, aux) -> 0, 1 (out of memory) or 2 (a token id out of
    range; nothing written); aux (a float32 scalar, or None) is set to 0 on success; None when the kernels are off
    or absent. With `LINATTN_DECODE_TIMING` set (read here, so once per plan built) the step of the timing build
    (`timing_library`), whose sections `section_times` reads."""
    if not timing_requested():
        lib = _library()
        return None if lib is None else lib.function("linattn_decode_model", dtype)
    lib = timing_library()
    return None if lib is None else _timed_call(lib.function("linattn_decode_model", dtype))


def greedy_function(dtype: torch.dtype):
    """The compiled greedy loop for dtype (as `model_function`; csrc/decode.c, linattn_decode_model_greedy):
    fn(byref(plan), ids, S_in, w_in, S_a, w_a, S_b, w_b, logits, aux, n, eos, kv_win, tokens) -> the steps run, or
    -1 (out of memory), -2 (a token id out of range), -3 (a KV cache it cannot advance; -2, -3: nothing run). The
    timing build's under `LINATTN_DECODE_TIMING`, its calls' wall time in "python seconds" as `model_function`'s."""
    if not timing_requested():
        lib = _library()
        return None if lib is None else lib.function("linattn_decode_model_greedy", dtype)
    lib = timing_library()
    return None if lib is None else _timed_call(lib.function("linattn_decode_model_greedy", dtype))


def _timed_call(fn):
    """fn with its calls' wall time as Python sees it added up (`section_times`'s "python seconds": the crossing
    in and out of ctypes is that time less the C function's own, "total")."""
    def timed(*args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            _python_seconds[0] += time.perf_counter() - t0
    return timed


#: the variable that makes a plan built while it is set run the timing build of the whole-model step
TIMING_SWITCH = "LINATTN_DECODE_TIMING"
#: csrc/decode.c's timed sections (its LT_* order): products by matrix (qkv: the mixer's fused input product, or
#: softmax attention's q / k / v / gate products), the mixers' own work, norms, the embedding, the head and the
#: logits' scaling and rounding; `total` is the whole-model call's wall time
SECTIONS = ("embed", "norm", "qkv", "conv", "state", "attn", "mixer", "out", "residual", "gate_up", "ffn_act", "down",
            "moe", "head", "logits", "setup", "teardown", "total")
_timing_lib: list = []   # [Bound or None] once built
_python_seconds = [0.0]   # the timing build's calls' wall time seen from Python (`_timed_call`), since the last reset


def timing_requested() -> bool:
    """Whether LINATTN_DECODE_TIMING asks for the timing build (set, and not 0 / false / off / no / empty)."""
    return os.environ.get(TIMING_SWITCH, "").strip().lower() not in ("", "0", "false", "off", "no")


# The timing build's one extra export (not in abi.py's table: the native library has none): name, return, arguments.
# tests/cpu/test_bindings.py checks it against decode.c's prototype.
TIMING_FUNCTION = ("linattn_decode_timing", ctypes.c_int64, [ctypes.c_void_p, ctypes.c_int])


def timing_library() -> Optional[bindings.Bound]:
    """decode.c built with LINATTN_DECODE_TIMING defined (a developer's build: each section of a decoded token timed
    into process-wide counters), bound like the native library; None when the kernels are off or it cannot be
    built. Cached by its sources' hash like every library (the define is part of them)."""
    if not enabled():
        return None
    if not _timing_lib:
        import tempfile
        from pathlib import Path

        from . import build as cbuild
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp)
            for f in cbuild.CSRC.iterdir():
                if f.is_file():
                    (src / f.name).write_bytes(f.read_bytes())
            (src / "decode.c").write_text("#define LINATTN_DECODE_TIMING 1\n" + (cbuild.CSRC / "decode.c").read_text())
            try:
                lib = ctypes.CDLL(str(cbuild.build("decode", src)))
            except (OSError, RuntimeError):
                lib = None
        if lib is not None and cbuild.interface_problem("decode", lib) is None:
            name, restype, argtypes = TIMING_FUNCTION
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
            _timing_lib.append(bindings.Bound("decode", lib))
        else:
            _timing_lib.append(None)
    return _timing_lib[0]


def section_times(reset: bool = True) -> Optional[dict]:
    """The timing build's counters since the last reset: {"tokens": whole-model calls, "seconds": {section: s},
    "bytes": {section: bytes read or written}} (`SECTIONS`), "python seconds": the same calls' wall time seen from
    Python around the ctypes call (so "python seconds" - "total" is the crossing of ctypes), summed over every plan
    of the process that runs the timing build; reset after reading when `reset`. None when the timing build was never
    loaded."""
    if not _timing_lib or _timing_lib[0] is None:
        return None
    n = len(SECTIONS)
    out = (ctypes.c_double * (2 * n + 1))()
    got = getattr(_timing_lib[0].lib, TIMING_FUNCTION[0])(out, int(reset))
    if got != n:
        raise RuntimeError(f"internal: the timing build has {got} sections, cpu/decode.SECTIONS {n}")
    py = _python_seconds[0]
    if reset:
        _python_seconds[0] = 0.0
    return {"tokens": int(out[2 * n]), "seconds": dict(zip(SECTIONS, out[:n])),
            "bytes": dict(zip(SECTIONS, out[n:2 * n])), "python seconds": py}


def weight_matvec(x: torch.Tensor, fmt: str, W: torch.Tensor, scales: Optional[torch.Tensor] = None, group: int = 0,
                  bias: Optional[torch.Tensor] = None, add: Optional[torch.Tensor] = None,
                  scales_in_step_order: bool = False) -> torch.Tensor:
    """y `[B, n]` = add + W x + bias for float32 x `[B, m]` through the compiled decode's one weight product
    (csrc/qmatvec.h `matvec_w_f32`, at torch's thread count), W in format fmt (`WEIGHT_FORMATS`): "plan" float32
    `[n, m]`, "bf16" `[n, m]`, "int8" `[n, m]` with bf16 scales `[n]`, "int4" uint8 `[n, m / 2]` (two codes a byte,
    quant/linear.py) with bf16 scales `[n, m / group]`, group 32 or 64; "int8_a8" / "int4_a8" the same weights
    times x rounded to int8 per block of 32 inputs (csrc/qmatvec.h). For tests and benchmarks (the plans call it
    from C); bias and add float32. Every tensor contiguous and on the CPU (`ptr` checks). "int4_a8" reads its
    scales in the steps' order (cpu/qlayout.step_scales, as plans keep them): scales by rows are put in that order
    here (a copy per call), unless `scales_in_step_order` says they are already (benchmarks)."""
    if x.dim() != 2 or x.dtype != torch.float32:
        raise LinattnError(f"weight_matvec: x must be float32 [B, m], got {x.dtype} {list(x.shape)}")
    B, m = x.shape
    n = W.shape[0] if W.dim() == 2 else -1
    want = {"plan": (torch.float32, (n, m), None), "bf16": (torch.bfloat16, (n, m), None),
            "int8": (torch.int8, (n, m), (n,)),
            "int4": (torch.uint8, (n, m // 2), (n, m // group) if group in (32, 64) and m % group == 0 else None)}
    want["int8_a8"], want["int4_a8"] = want["int8"], want["int4"]
    if fmt not in want:
        raise LinattnError(f"weight_matvec: fmt must be one of {sorted(want)}, got {fmt!r}")
    wdt, wshape, sshape = want[fmt]
    if (W.dtype, tuple(W.shape)) != (wdt, wshape) or (fmt.startswith("int4") and sshape is None) or (
            sshape is not None and (scales is None or scales.dtype != torch.bfloat16 or tuple(scales.shape) != sshape)):
        raise LinattnError(f"weight_matvec ({fmt}): W must be {wdt} {list(wshape)}"
                           + (f", scales bfloat16 {list(sshape)}" if sshape else "")
                           + (" (group 32 or 64 dividing m)" if fmt.startswith("int4") else "")
                           + f"; got W {W.dtype} {list(W.shape)}, scales "
                           + ("None" if scales is None else f"{scales.dtype} {list(scales.shape)}")
                           + f", group {group}")
    for name, t, shape in (("bias", bias, (n,)), ("add", add, (B, n))):
        if t is not None and (t.dtype != torch.float32 or tuple(t.shape) != shape):
            raise LinattnError(f"weight_matvec: {name} must be float32 {list(shape)}, got {t.dtype} {list(t.shape)}")
    if fmt == "int4_a8" and not scales_in_step_order:
        scales = step_scales(scales)
    lib = _library()
    y = torch.empty(B, n, dtype=torch.float32)
    lib("linattn_decode_matvec_f32", None, WEIGHT_FORMATS[fmt], ptr(W), ptr(scales if sshape else None), group, B,
        n, m, ptr(bias), ptr(x), ptr(add), ptr(y), threads())
    return y


def moe_route(logits: torch.Tensor, k: int, norm: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """A mixture of experts' routing as the compiled decode computes it (csrc/decode_moe.h): for float32 router
    logits `[R, E]`, the softmax's k largest probabilities as torch.topk chooses them on the CPU (ties included),
    renormalised over the k when `norm`. Returns (indices int64 `[R, k]`, increasing; weights float32 `[R, k]`).
    For tests (the plans route in C)."""
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise LinattnError(f"moe_route: logits must be float32 [R, E], got {logits.dtype} {list(logits.shape)}")
    R, E = logits.shape
    if not 1 <= k <= E:
        raise LinattnError(f"moe_route: k must be in [1, E = {E}], got {k}")
    lg = logits.contiguous()
    idx, w = torch.empty(R, k, dtype=torch.int64), torch.empty(R, k, dtype=torch.float32)
    _library()("linattn_decode_moe_route", None, R, E, k, int(bool(norm)), ptr(lg), ptr(idx), ptr(w))
    return idx, w


def moe_route_grouped(logits: torch.Tensor, bias: torch.Tensor, k: int, groups: int, topk_groups: int, norm: bool,
                      scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Router mode 2 as the compiled decode computes it (csrc/decode_moe.h, DeepSeek-V3's `TopkRouter`): for
    float32 router logits `[R, E]` and the correction bias `[E]`, the k experts chosen on sigmoid(logits) + bias
    within the `topk_groups` best of `groups` groups, as torch.topk chooses them on the CPU (ties included); their
    sigmoid scores (renormalised when `norm`) times `scale`. Returns (indices int64 `[R, k]`, increasing; weights
    float32 `[R, k]`). For tests (the plans route in C)."""
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise LinattnError(f"moe_route_grouped: logits must be float32 [R, E], got {logits.dtype} "
                           f"{list(logits.shape)}")
    R, E = logits.shape
    if bias.dtype != torch.float32 or tuple(bias.shape) != (E,):
        raise LinattnError(f"moe_route_grouped: bias must be float32 [{E}], got {bias.dtype} {list(bias.shape)}")
    if groups < 1 or E % groups or E // groups < 2 or not 1 <= topk_groups <= groups:
        raise LinattnError(f"moe_route_grouped: groups must divide E = {E} into groups of >= 2 and topk_groups be in "
                           f"[1, groups], got {groups}, {topk_groups}")
    if not 1 <= k <= topk_groups * (E // groups):
        raise LinattnError(f"moe_route_grouped: k must be in [1, {topk_groups * (E // groups)}], got {k}")
    lg, b = logits.contiguous(), bias.contiguous()
    idx, w = torch.empty(R, k, dtype=torch.int64), torch.empty(R, k, dtype=torch.float32)
    _library()("linattn_decode_moe_route_grouped", None, R, E, k, groups, topk_groups, int(bool(norm)), float(scale),
               ptr(lg), ptr(b), ptr(idx), ptr(w))
    return idx, w
