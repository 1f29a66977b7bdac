"""The interface of every compiled library of csrc/, declared once: one table per library with its ABI version,
its functions (C argument types, return type, whether it has float and double variants, what its return codes
mean) and the plan structs it takes.

`build.py` checks a loaded library against its table (every symbol exported, `linattn_<lib>_abi_version()` equal
to `abi`, `linattn_sizeof_<plan>()` equal to the ctypes struct's size) and `bindings.py` binds the functions from
it; `tests/cpu/test_bindings.py` parses the C prototypes and checks every entry here against them. A change of a
C signature changes its entry here and the library's ABI version (`LA_ABI_VERSION` in its source) together.

Pointer arguments are `c_void_p` (tensor data addresses, None for NULL); `REAL` pointers take the float32 data in
`<name>_f32` and the float64 data in `<name>_f64`. Imports only ctypes: `build.py` and `bindings.py` import it.
"""
from __future__ import annotations

import ctypes
from typing import Dict, NamedTuple, Optional, Tuple

c_ptr, c_i64, c_int, c_double, c_float = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double, ctypes.c_float

#: what a nonzero return code means, for every function that returns int unless its entry says otherwise
OUT_OF_MEMORY = "could not allocate its scratch memory"
#: csrc/linear_log.c's refusal of features wider than its LL_MAX_FEATURES (the dispatch checks it first)
LOG_MAX_FEATURES = 4096
LOG_ERRORS = {1: OUT_OF_MEMORY, 2: f"takes at most {LOG_MAX_FEATURES} features (K_phi)"}


class LinearPlan(ctypes.Structure):
    """`linattn_linear_plan` (csrc/linear.c): a chunk call's shapes and options besides its tensors."""

    _fields_ = ([(n, ctypes.c_int64) for n in ("N", "H", "K", "V", "C")] + [("starts", ctypes.c_void_p)]
                + [(n, ctypes.c_int32) for n in ("norm", "fmap", "nthreads", "pad_")]
                + [(n, ctypes.c_double) for n in ("scale", "eps")])


class LinearLogPlan(ctypes.Structure):
    """`linattn_linear_log_plan` (csrc/linear_log.c): shapes, sequence offsets, checkpoint interval, threads."""

    _fields_ = ([(n, ctypes.c_int64) for n in ("N", "H", "K", "V", "C")] + [("starts", ctypes.c_void_p)]
                + [(n, ctypes.c_int32) for n in ("nthreads", "pad_")])


class DeltaPlan(ctypes.Structure):
    """`linattn_delta_plan` (csrc/delta.c): a scan's shapes, sequence and checkpoint offsets, gate kind, threads."""

    _fields_ = ([(n, ctypes.c_int64) for n in ("N", "H", "K", "V", "chunk")]
                + [(n, ctypes.c_void_p) for n in ("starts", "ck_off")]
                + [(n, ctypes.c_int32) for n in ("gate", "nthreads")])


class Fn(NamedTuple):
    """One exported function: `name` (with `_f32` / `_f64` appended when `typed`), its argument types, its return
    type; `status`: the int it returns is a status code (0 success), whose nonzero values `errors` explains
    (None: any nonzero code means `OUT_OF_MEMORY`)."""

    name: str
    args: Tuple
    restype: Optional[type] = c_int
    typed: bool = True
    status: bool = True
    errors: Optional[Dict[int, str]] = None


class Library(NamedTuple):
    """One compiled library: its ABI version, its functions, and its plan structs by the name `LA_EXPORT_SIZEOF`
    exports (`linattn_sizeof_<name>`). `bound_by`: a module that sets the argument types itself (the table then
    lists the symbols and version the loader checks, and the prototype test reads the module's own types)."""

    abi: int
    functions: Tuple[Fn, ...]
    structs: Dict[str, type] = {}
    bound_by: Optional[str] = None


def _plan(struct) -> type:
    return ctypes.POINTER(struct)


LIBRARIES: Dict[str, Library] = {
    "probe": Library(2, (
        Fn("linattn_probe_threads", (c_int,), typed=False, status=False),
        Fn("linattn_probe_axpy", (c_i64, c_float, c_ptr, c_ptr), restype=None, typed=False, status=False),
        Fn("linattn_probe_exp", (c_i64, c_ptr, c_ptr), restype=None, status=False),
    )),
    "linear": Library(2, (
        Fn("linattn_linear_nchunks", (c_i64, c_ptr, c_i64), restype=c_i64, typed=False, status=False),
        # plan, q, k, v, g, S0 -> num, den, P, S_out, nonfinite (int32 flag)
        Fn("linattn_linear_fwd", (_plan(LinearPlan),) + (c_ptr,) * 10),
        # plan, q, k, v, g, P, dnum, dden, o, den, dS -> dq, dk, dv, dg, dS0
        Fn("linattn_linear_bwd", (_plan(LinearPlan),) + (c_ptr,) * 15),
    ), {"linear_plan": LinearPlan}),
    "linear_log": Library(1, (
        Fn("linattn_linear_log_nchunks", (c_i64, c_ptr, c_i64), restype=c_i64, typed=False, status=False),
        # plan, lq, lk, v, g, S0, mu0 -> num, den, c, S, mu, P, Pmu
        Fn("linattn_linear_log_fwd", (_plan(LinearLogPlan),) + (c_ptr,) * 13, errors=LOG_ERRORS),
        # plan, lq, lk, v, g, mu0, c, P, Pmu, mu_end, dnum, dden, dS -> dlq, dlk, dv, dg, dS0
        Fn("linattn_linear_log_bwd", (_plan(LinearLogPlan),) + (c_ptr,) * 17, errors=LOG_ERRORS),
    ), {"linear_log_plan": LinearLogPlan}),
    "delta": Library(3, (
        # plan, q, k, v, a, decays, S0 -> o, S_out, ckpt
        Fn("linattn_delta_fwd", (_plan(DeltaPlan),) + (c_ptr,) * 9),
        # plan, q, k, v, a, decays, ckpt, do, dS (in: dL/dS_final, out: dL/dS0) -> dq, dk, dv, da, dg
        Fn("linattn_delta_bwd", (_plan(DeltaPlan),) + (c_ptr,) * 13),
    ), {"delta_plan": DeltaPlan}),
    "deltaprep": Library(1, (
        # R, K, V, q, k, v, beta, scale, eps -> qo, ko, vo, a; threads
        Fn("linattn_dprep_fwd", (c_i64,) * 3 + (c_ptr,) * 4 + (c_double,) * 2 + (c_ptr,) * 4 + (c_int,)),
        # R, K, V, q, k, scale, eps, dqo, dko, dvo, da -> dq, dk, dv, dbeta; threads
        Fn("linattn_dprep_bwd", (c_i64,) * 3 + (c_ptr,) * 2 + (c_double,) * 2 + (c_ptr,) * 8 + (c_int,)),
        # R, K, V, q, k, v, scale -> qo, ko, vo, lam (float64); threads
        Fn("linattn_dprep_raw_fwd", (c_i64,) * 3 + (c_ptr,) * 3 + (c_double,) + (c_ptr,) * 4 + (c_int,)),
        # R, K, V, k, scale, dqo, dko, dvo, dlam (float64) -> dq, dk, dv; threads
        Fn("linattn_dprep_raw_bwd", (c_i64,) * 3 + (c_ptr,) + (c_double,) + (c_ptr,) * 7 + (c_int,)),
        Fn("linattn_l2rows_fwd", (c_i64,) * 2 + (c_ptr,) + (c_double,) + (c_ptr,) + (c_int,)),
        Fn("linattn_l2rows_bwd", (c_i64,) * 2 + (c_ptr,) + (c_double,) + (c_ptr,) * 2 + (c_int,)),
    )),
    "conv": Library(1, (
        # B, T, D, K, xp, w, bias, act -> y, pre; threads
        Fn("linattn_conv_fwd", (c_i64,) * 4 + (c_ptr,) * 3 + (c_int,) + (c_ptr,) * 2 + (c_int,)),
        # B, T, D, K, xp, w, pre, gy -> dxp, dw, db; threads
        Fn("linattn_conv_bwd", (c_i64,) * 4 + (c_ptr,) * 7 + (c_int,)),
        # B, T, D, K, x, past, w, bias, act -> y, pre; threads
        Fn("linattn_conv_fwd_sep", (c_i64,) * 4 + (c_ptr,) * 4 + (c_int,) + (c_ptr,) * 2 + (c_int,)),
        # B, T, D, K, x, past, w, bias, act, gy -> dx, dpast, dw, db; threads
        Fn("linattn_conv_bwd_sep", (c_i64,) * 4 + (c_ptr,) * 4 + (c_int,) + (c_ptr,) * 5 + (c_int,)),
    )),
    "gatednorm": Library(1, (
        # R, D, x, gate, w, eps -> y, rstd; threads
        Fn("linattn_gnorm_fwd", (c_i64,) * 2 + (c_ptr,) * 3 + (c_double,) + (c_ptr,) * 2 + (c_int,)),
        # R, D, x, gate, w, rstd, dy -> dx, dgate, dw; threads
        Fn("linattn_gnorm_bwd", (c_i64,) * 2 + (c_ptr,) * 8 + (c_int,)),
    )),
    "rwkv7": Library(1, (
        # N, H, K, V, starts, r, decay, k, v, a, b, scale, S0 -> o, S, ckpt; ck_off, checkpoint, threads
        Fn("linattn_rwkv7_fwd", (c_i64,) * 4 + (c_ptr,) * 7 + (c_double,) + (c_ptr,) * 5 + (c_i64, c_int)),
        # N, H, K, V, starts, r, decay, k, v, a, b, scale, S0, ckpt, checkpoint, ... -> gradients; threads
        Fn("linattn_rwkv7_bwd", (c_i64,) * 4 + (c_ptr,) * 7 + (c_double,) + (c_ptr,) * 2 + (c_i64,) + (c_ptr,) * 8
           + (c_int,)),
    )),
    # decode.c's functions are bound by cpu/decode.py (their plan structs live there)
    "decode": Library(3, tuple(Fn(f"linattn_decode_{stem}", ()) for stem in ("delta", "linear", "block", "model")),
                      bound_by="linattn.cpu.decode"),
}


def symbols(name: str) -> Tuple[str, ...]:
    """Every symbol library `name` must export: its functions (both variants of a typed one), the ABI version
    function and the sizeof function of each plan struct."""
    lib = LIBRARIES[name]
    out = [f"linattn_{name}_abi_version"] + [f"linattn_sizeof_{s}" for s in lib.structs]
    for fn in lib.functions:
        out += [f"{fn.name}_f32", f"{fn.name}_f64"] if fn.typed else [fn.name]
    return tuple(out)
