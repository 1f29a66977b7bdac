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
                + [(n, ctypes.c_int32) for n in ("gate", "nthreads")]
                # (fs) the forward's own preparation of the raw rows (csrc/delta.c PREP_*; 0: none) and its scale, eps
                + [(n, ctypes.c_int32) for n in ("prep", "pad_")] + [(n, ctypes.c_double) for n in ("scale", "eps")])


#: a block plan's weight matrices (each with `fmt_`, `grp_` (int4 group) and `sc_` (bf16 scales) fields)
WEIGHT_MATRICES = ("W", "Wo", "Wgu", "Wd", "Wq", "Wk", "Wv", "Wg")
#: KDA's second-stage matrices (the gate's and the low-rank output gate's), with the same three fields each
KDA_MATRICES = ("Wf", "Wg2")
#: (k46) the matrices of MLA's second products and a MoE shared expert's gate, with the same three fields each
SECOND_MATRICES = ("mla_Wkb", "mla_Wqb", "Wsg")
#: the fused products a block plan may read from separate matrices, and the most parts each (csrc/decode.c
#: PLAN_PARTS)
FUSED_PRODUCTS = ("W", "Wgu")
PLAN_PARTS = 8


class BlockPlan(ctypes.Structure):
    """`linattn_block_plan` (csrc/decode.c): what a whole-block decoding step needs besides the token and the state,
    fixed while the layer's parameters are. Pointer fields are data addresses (0: NULL); `keep` holds the tensors
    they point into (set by the builder, models/decode_plan.py). `wbf16` (float32 plans): the matrices W, Wo, Wgu
    and Wd are stored as bfloat16, read with fp32 accumulation. kind 2 is softmax attention (its projections Wq, Wk,
    Wv, Wg; the KV cache's buffers and the token's row and positions set per call, models/decode_plan.py). Kinds 3
    and 4 are linear attention with ELA's maps (`ela_map`): log-space Hadamard Exp (csrc/decode_log.h, `log_decay`;
    a layer's state [B, HV, K, V + 2] = kv | z | log-scale) and the linear-space squared-Euclidean and
    magnitude-direction kernels (csrc/decode_ela.h).
    `fmt_<M>` (float32 plans, 0: as `wbf16` says): matrix M's own format (`cpu/decode.WEIGHT_FORMATS`), int8 /
    int4 with bf16 scales `sc_<M>` and int4 group `grp_<M>` (csrc/qmatvec.h)."""

    _fields_ = ([(n, ctypes.c_int64) for n in ("B", "H", "HV", "K", "V", "d", "ny", "KC", "hid")]
                + [(n, ctypes.c_int32) for n in ("kind", "conv_act", "dkind", "l2conv", "q_l2", "beta_mode", "gated",
                                                 "fmap", "gate_kind", "normalize", "nonneg", "has_norm", "has_gate",
                                                 "has_ffn", "nthreads", "wbf16")]
                + [(n, ctypes.c_double) for n in ("l2eps", "scale", "eps", "norm_eps", "n1eps", "n2eps")]
                + [(n, ctypes.c_void_p) for n in ("n1w", "W", "Wb", "cw", "cb", "alpha", "neg_a", "dt_bias", "decay",
                                                  "nw", "Wo", "n2w", "Wgu", "bgu", "Wd", "bd")]
                # softmax attention (kind 2): fixed per plan, except kv_cap .. lo0, kc, vc, pos, lo (set per call)
                + [(n, ctypes.c_int64) for n in ("kvh", "rot", "kv_cap", "kv_len", "pos0", "lo0")]
                + [(n, ctypes.c_int32) for n in ("att_gate", "gate_sig", "qk_norm", "kv_bf16", "rope_f32", "pad2_")]
                + [(n, ctypes.c_double) for n in ("qk_eps", "rope_scale")]
                + [(n, ctypes.c_void_p) for n in ("Wq", "bq", "Wk", "bk", "Wv", "bv", "Wg", "qnw", "knw", "inv_freq",
                                                  "kc", "vc", "pos", "lo")]
                + [(f"fmt_{n}", ctypes.c_int32) for n in WEIGHT_MATRICES]
                + [(f"grp_{n}", ctypes.c_int64) for n in WEIGHT_MATRICES]
                + [(f"sc_{n}", ctypes.c_void_p) for n in WEIGHT_MATRICES]
                # KDA (kind 4) and Mamba2 (kind 5): csrc/decode_kda.h, csrc/decode_mamba2.h; `bo` o_proj's bias
                + [(n, ctypes.c_int64) for n in ("rank_f", "rank_g", "n_groups")]
                + [(n, ctypes.c_int32) for n in ("gate_lb_on", "norm_mode", "d_per_channel", "pad3_")]
                + [(n, ctypes.c_double) for n in ("gate_lb", "dt_lo", "dt_hi")]
                + [(n, ctypes.c_void_p) for n in ("Wf", "Wg2", "bg2", "Dsk", "bo")]
                + [(f"fmt_{n}", ctypes.c_int32) for n in KDA_MATRICES]
                + [(f"grp_{n}", ctypes.c_int64) for n in KDA_MATRICES]
                + [(f"sc_{n}", ctypes.c_void_p) for n in KDA_MATRICES]
                # ELA's maps: kind 3 log-space (csrc/decode_log.h: ela_map 0 Hadamard Exp, log_decay RetNet's log
                # gamma [HV]), kind 6 linear-space (csrc/decode_ela.h: ela_map 1 / 2 sum / sub squared-Euclidean,
                # 3 magnitude-direction)
                + [("ela_map", ctypes.c_int32), ("pad4_", ctypes.c_int32), ("log_decay", ctypes.c_void_p)]
                # the residual order: postnorm 0 pre-norm, 1 post-norm (OLMo-hybrid's attention blocks: n1w / n2w
                # on the mixer's / the FFN's output before each residual add)
                + [("postnorm", ctypes.c_int32), ("pad5_", ctypes.c_int32)]
                # fused products read from their parts (no concatenated copy): `FUSED_PARTS` per product, part i
                # at parts_<M>[i] with rows_<M>[i] rows, nparts_<M> 0: <M> is one matrix
                + [("nparts_W", ctypes.c_int32), ("nparts_Wgu", ctypes.c_int32)]
                + [(f, t * PLAN_PARTS) for n in FUSED_PRODUCTS
                   for f, t in ((f"parts_{n}", ctypes.c_void_p), (f"rows_{n}", ctypes.c_int64))]
                # a mixture-of-experts feed-forward (ffn_kind 1, csrc/decode_moe.h; 0 the dense SwiGLU): the router
                # Wr [E, d], the experts' fused Weg [E, 2 moe_hid, d] / Wed [E, d, moe_hid] read in place, the
                # shared expert in Wgu / Wd (hid > 0) gated by sigmoid(Wsg x) (Wsg NULL: ungated)
                + [(n, ctypes.c_int64) for n in ("n_experts", "top_k", "moe_hid")]
                + [(n, ctypes.c_int32) for n in ("ffn_kind", "norm_topk")]
                + [(n, ctypes.c_void_p) for n in ("Wr", "Weg", "Wed", "Wsg")]
                # Mamba2 (kind 5): state_pn 1 keeps a head's state [P, N] (transformers' layout, no z column), 0
                # [N, P + 1] (linear attention's kv | z)
                + [("state_pn", ctypes.c_int32), ("pad6_", ctypes.c_int32)]
                # MLA (kind 7, csrc/decode_mla.h): latent rank, nope / rope / q-lora dims, the head-wise gate,
                # the latent's and q_a's RMSNorms, kv_b_proj and q_b_proj
                + [(n, ctypes.c_int64) for n in ("mla_rank", "mla_nope", "mla_rope", "mla_qr")]
                + [(n, ctypes.c_int32) for n in ("mla_gate", "pad_mla_")]
                + [(n, ctypes.c_double) for n in ("mla_kv_eps", "mla_q_eps")]
                + [(n, ctypes.c_void_p) for n in ("mla_Wkb", "mla_kvnw", "mla_Wqb", "mla_qnw")]
                # MoE router mode 2 (csrc/decode_moe.h: DeepSeek-V3's sigmoid grouped top-k with a correction
                # bias e_bias for the choice and a routed scaling factor)
                + [(n, ctypes.c_int64) for n in ("moe_groups", "moe_topk_groups")]
                + [(n, ctypes.c_int32) for n in ("router", "router_wbf16")]
                + [("routed_scale", ctypes.c_double), ("e_bias", ctypes.c_void_p)]
                # the scaled residual orders (res_scaled; a, b per half: out = a res + b branch): 1, MiniMax's (the
                # normed input is the residual: h = a1 n1(x) + b1 mixer, x_out = a2 n2(h) + b2 ffn); 2, Granite's
                # residual multiplier (h = x + b1 mixer, x_out = h + b2 ffn; a1 = a2 = 1). Lightning attention is
                # kind 8 (csrc/decode_lightning.h: `decay` exp(-slope) per head, one RMSNorm over all heads' outputs)
                + [("res_scaled", ctypes.c_int32), ("pad_mx_", ctypes.c_int32)]
                + [(n, ctypes.c_double) for n in ("res_a1", "res_b1", "res_a2", "res_b2")]
                # Granite / Nemotron-H: ffn_only, a block without a mixer (h = x, its norm in n2w: Nemotron-H's MLP /
                # MoE blocks); ffn_act 1, a non-gated relu^2 FFN (dense, experts, shared expert: Wgu / Weg hold the up
                # rows only), 0 SwiGLU
                + [(n, ctypes.c_int32) for n in ("ffn_only", "ffn_act")]
                # (k46) quantized second products: MLA's kv_b_proj / q_b_proj and a MoE shared expert's gate, each
                # with `fmt_` / `grp_` / `sc_` fields as the `WEIGHT_MATRICES`
                + [(f"fmt_{n}", ctypes.c_int32) for n in SECOND_MATRICES] + [("pad_k46_", ctypes.c_int32)]
                + [(f"grp_{n}", ctypes.c_int64) for n in SECOND_MATRICES]
                + [(f"sc_{n}", ctypes.c_void_p) for n in SECOND_MATRICES])


class ModelPlan(ctypes.Structure):
    """`linattn_model_plan` (csrc/decode.c): a whole model's decoding step (`linattn_decode_model`): the embedding,
    L block plans, the final RMSNorm and the head, and where each layer's state and conv window sit in the step's
    state / window buffers. Built in models/decode_plan.py (`model_step`), which keeps what it points into.
    `wbf16` (float32 plans): the embedding and head are bfloat16 too, and the logits are written as bfloat16.
    `fmt_head` / `grp_head` / `sc_head`: the head's own format (as a block plan's `fmt_<M>`)."""

    _fields_ = ([(n, ctypes.c_int64) for n in ("L", "B", "d", "vocab")]
                + [(n, ctypes.c_int32) for n in ("has_norm", "nthreads", "wbf16", "pad_")]
                + [("norm_eps", ctypes.c_double)]
                + [(n, ctypes.c_void_p) for n in ("embed", "norm_w", "head", "blocks", "s_off", "w_off")]
                + [("fmt_head", ctypes.c_int32), ("pad2_", ctypes.c_int32), ("grp_head", ctypes.c_int64),
                   ("sc_head", ctypes.c_void_p)]
                # Granite / Nemotron-H: the embedded row times emb_scale (Granite's embedding_multiplier), the
                # logits divided by logits_div (its logits_scaling), each when its flag is set
                + [(n, ctypes.c_int32) for n in ("emb_scaled", "logits_scaled")]
                + [(n, ctypes.c_double) for n in ("emb_scale", "logits_div")]
                # (o52) per call, NULL or L addresses: layer l's input state at s_in_at[l] instead of S_in + s_off[l]
                + [("s_in_at", ctypes.c_void_p)]
                # (kg) per call, NULL or L addresses: layer l's conv state as transformers keeps it, [B, C, KC], read
                # and advanced in place to [old[1:] | x] instead of w_in / w_out + w_off[l] (kinds 0, 1, 4, 5)
                + [("w_io_at", ctypes.c_void_p)])


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
    exports (`linattn_sizeof_<name>`)."""

    abi: int
    functions: Tuple[Fn, ...]
    structs: Dict[str, type] = {}


def _plan(struct) -> type:
    return ctypes.POINTER(struct)


LIBRARIES: Dict[str, Library] = {
    "probe": Library(3, (
        Fn("linattn_probe_threads", (c_int,), typed=False, status=False),
        Fn("linattn_probe_axpy", (c_i64, c_float, c_ptr, c_ptr), restype=None, typed=False, status=False),
        Fn("linattn_probe_exp", (c_i64, c_ptr, c_ptr), restype=None, status=False),
        # bench infer's floor: the bandwidth pass (n, x, nthreads, out: the sum, one double)
        Fn("linattn_probe_read_sum", (c_i64, c_ptr, c_int, c_ptr), restype=None, typed=False, status=False),
        # the decode conv's SiLU: n, x (float), y, path (0 scalar, 1 GCC's vector loop, 2 la_silu_ymm) -> 1: path 2
        # not compiled
        Fn("linattn_probe_silu_f32", (c_i64, c_ptr, c_ptr, c_int), typed=False, status=False),
    )),
    "linear": Library(3, (
        Fn("linattn_linear_nchunks", (c_i64, c_ptr, c_i64), restype=c_i64, typed=False, status=False),
        # plan, q, k, v, g, S0 -> num, den, P, S_out, nonfinite (int32 flags: 1 num, 2 output held inf / NaN)
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
    "delta": Library(4, (
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
        # R, K, V, q, k, v, beta, scale -> qo, ko, vo, a = beta max(|k|^2, 1); threads
        Fn("linattn_dprep_rawa_fwd", (c_i64,) * 3 + (c_ptr,) * 4 + (c_double,) + (c_ptr,) * 4 + (c_int,)),
        # R, K, V, k, scale, dqo, dko, dvo, da -> dq, dk, dv, dbeta; threads
        Fn("linattn_dprep_rawa_bwd", (c_i64,) * 3 + (c_ptr,) + (c_double,) + (c_ptr,) * 8 + (c_int,)),
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
    "decode": Library(7, (
        # B, H, HV, K, V, y, ldy, KC, w_in, cw, cb, conv_act, w_out, kind, l2conv, q_l2, l2eps, scale, beta_mode,
        # alpha, gated, neg_a, dt_bias, S_in, S_out, has_norm, nw, norm_eps, has_gate, out, threads
        Fn("linattn_decode_delta", (c_i64,) * 5 + (c_ptr, c_i64, c_i64) + (c_ptr,) * 3 + (c_int, c_ptr) + (c_int,) * 3
           + (c_double,) * 2 + (c_int, c_ptr, c_int) + (c_ptr,) * 4 + (c_int, c_ptr, c_double, c_int, c_ptr, c_int)),
        # B, H, HV, K, V, y, ldy, KC, w_in, cw, cb, conv_act, w_out, fmap, scale, gate_kind, decay, neg_a, dt_bias,
        # S_in, S_out, normalize, nonneg, eps, has_norm, nw, norm_eps, has_gate, out, threads
        Fn("linattn_decode_linear", (c_i64,) * 5 + (c_ptr, c_i64, c_i64) + (c_ptr,) * 3 + (c_int, c_ptr)
           + (c_int, c_double, c_int) + (c_ptr,) * 5 + (c_int, c_int, c_double) + (c_int, c_ptr, c_double, c_int, c_ptr,
                                                                                  c_int)),
        # plan, x, w_in, S_in -> w_out, S_out, x_out
        Fn("linattn_decode_block", (_plan(BlockPlan),) + (c_ptr,) * 6),
        # plan, ids, S_in, w_in -> S_out, w_out, logits, aux
        Fn("linattn_decode_model", (_plan(ModelPlan),) + (c_ptr,) * 7,
           errors={1: OUT_OF_MEMORY, 2: "was given a token id outside [0, vocab) (nothing written)",
                   3: "was given a conv state in place (w_io_at) for a block kind other than 0, 1, 4, 5"}),
        # fmt, W, scales, group, B, n, m, bias, x, add -> y; threads
        Fn("linattn_decode_matvec_f32", (c_int, c_ptr, c_ptr) + (c_i64,) * 4 + (c_ptr,) * 4 + (c_int,), restype=None,
           typed=False, status=False),
        # R, E, k, norm, logits (float) -> idx (int64, increasing), w (float): a mixture of experts' routing
        Fn("linattn_decode_moe_route", (c_i64,) * 3 + (c_int,) + (c_ptr,) * 3, typed=False),
        # R, E, k, groups, topk_groups, norm, scale, logits (float), bias (float) -> idx, w: router mode 2
        Fn("linattn_decode_moe_route_grouped", (c_i64,) * 5 + (c_int, c_double) + (c_ptr,) * 4, typed=False),
        # (g46) plan, ids, S_in, w_in, S_a, w_a, S_b, w_b, logits, aux, n, eos, kv_win -> tokens: up to n greedy steps;
        # returns the steps run, or -1 out of memory, -2 an id out of range, -3 a KV cache it cannot advance
        Fn("linattn_decode_model_greedy", (_plan(ModelPlan),) + (c_ptr,) * 9 + (c_i64, c_i64, c_ptr, c_ptr),
           restype=c_i64, status=False),
        # (k46 attn) bf16 keys, keys, first, stride, nt, D, q, scale -> w: one head's softmax scores (tests)
        Fn("linattn_decode_kv_scores", (c_int, c_ptr) + (c_i64,) * 4 + (c_ptr, c_double, c_ptr), restype=None,
           status=False),
    ), {"block_plan": BlockPlan, "model_plan": ModelPlan}),
    "dequant": Library(1, (
        # R, K, q (int8), scales (bf16), form (0 exact fp32, 1 bf16-rounded fp32, 2 bf16) -> out; threads
        Fn("linattn_dequant_int8", (c_i64,) * 2 + (c_ptr,) * 2 + (c_int, c_ptr, c_int), typed=False),
        # R, K, group, packed (uint8), scales (bf16), form -> out; threads
        Fn("linattn_dequant_int4", (c_i64,) * 3 + (c_ptr,) * 2 + (c_int, c_ptr, c_int), typed=False),
    )),
    "prefetch": Library(1, (
        # n, lines (uint64 addresses): a prefetch of each (the decode plans' guard: cpu/prefetch.py)
        Fn("linattn_prefetch_lines", (c_i64, c_ptr), restype=None, typed=False, status=False),
    )),
    "guard": Library(1, (
        # lay, nd, dicts, dvers, nt, rec, nv, vrec -> 1 when every recorded word is unchanged (cpu/guard.py)
        Fn("linattn_guard_same", (c_ptr, c_i64, c_ptr, c_ptr, c_i64, c_ptr, c_i64, c_ptr), restype=c_i64,
           typed=False, status=False),
    )),
}


def symbols(name: str) -> Tuple[str, ...]:
    """Every symbol library `name` must export: its functions (both variants of a typed one), the ABI version
    function and the sizeof function of each plan struct."""
    lib = LIBRARIES[name]
    out = [f"linattn_{name}_abi_version"] + [f"linattn_sizeof_{s}" for s in lib.structs]
    for fn in lib.functions:
        out += [f"{fn.name}_f32", f"{fn.name}_f64"] if fn.typed else [fn.name]
    return tuple(out)
