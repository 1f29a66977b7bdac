"""`linattn bench ops`: operator speed against sequence length T.

For each T: causal normalised elu+1 `linear_attention` and Mamba2's SSD (grouped scalar-gated linear
attention, as its block calls it), the delta rule (DeltaNet, Gated DeltaNet, EFLA), its variants (Comba,
DeltaProduct, Kimi Delta Attention, RWKV-7), the test-time family (MesaNet, TTT-Linear, TTT-MLP, Titans),
the softmax side (FoX, DeltaFormer, PaTH: chunk form only) and `softmax_attention` (SDPA), forward and
forward+backward, chunk and recurrent forms (recurrent only up to a cap: it is a Python loop over
tokens). Reports ms (median and spread), speed-up over softmax and over the op's own recurrent form,
achieved GFLOP/s against the machine's measured matmul rate, and peak memory; then the issue's
targets at T = 16384, computed from this run. Nothing is extrapolated: what is not measured is
listed as skipped, with the reason. The chunk size reported, and used in the flop counts, is the
one the backend really ran with (`linattn.ops.chunk_size_used`), which can differ from --chunk-size.
`--backends torch,cpu` (any of auto, torch, triton, cpu) runs every operator that takes a `backend` argument
(linear attention, the delta rule and its variants) once per backend, interleaved in the same rounds, labels
the rows `[backend]`, adds each row's speed-up over the first backend listed, and checks the targets per backend.

Each row is one `BenchOp` (its inputs, its call, its flop count and how its chunk size is found), added by
`register_bench_op`: adding an operator to the benchmark is one such definition (see CONTRIBUTING.md).
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from ..cli_support import UsageError, int_at_least
from ..io import atomic_write_text, write_json
from ..ops import (
    chunk_size_used,
    comba,
    delta_product,
    delta_rule,
    deltaformer,
    forgetting_attention,
    linear_attention,
    mesa_net,
    path_attention,
    rwkv7,
    softmax_attention,
    titans,
    ttt,
)
from ..plotting import save_figure
from . import common

DESCRIPTION = __doc__.split("\n\n")[0] + """

Flop conventions (per forward; forward+backward counts 3x the forward; C = the chunk size the backend
really uses, printed in column C and recorded as chunk_size_used, which can differ from --chunk-size):
  linear chunk      4*B*H*T*K*(C+V)   (q.k^T and A.v inside chunks, k^T.v and q.S across)
  linear recurrent  4*B*H*T*K*V
  Mamba2 SSD chunk  2*B*G*T*C*K + B*H*T*(2*C*V + 4*K*V)   (q.k^T once per group of B/C, G = 1; per value head
                    A.v within chunks, k^T.v and q.S across); recurrent 4*B*H*T*K*V
  delta chunk       B*H*T*(6*C*K + 4*C*V + 6*K*V)   (WY/UT form; the triangular solve is not counted)
  delta recurrent   6*B*H*T*K*V
                    (the same for Comba and KDA; DeltaProduct counts T*n sub-steps, C in sub-steps)
  softmax           2*B*H*T^2*(K+V)   (counts the masked half too; causal kernels do about half of it)
  FoX chunk         B*H*T*(T+C)*(K+V)  (the block pairs on and below the diagonal the sweep computes)
  DeltaFormer chunk 2*B*H*T*(T+C)*(K+V)  (stage one, then stage two: two such sweeps)
  PaTH chunk        B*H*T*((T+C)*(K+V) + 2*T*K)  (the scores and values, plus moving the key cache
                    across every block; the intra-block UT solves are not counted)
  MesaNet chunk     B*H*T*(I*(4*C*K + 2*K^2) + 2*K*(K+V) + 2*C*(K+V) + 2*K*V)   (solver="cg" with
                    I = max_iter = 30 iterations and tol=0, so every token runs all of them)
  MesaNet recurrent B*H*T*(2*K*(K+V) + 2*I*K^2 + 2*K*V)
  TTT / Titans      B*H*T*sum over inner layers (a -> b) of (6*a*b + 2*M*(a+b)), M = mini_batch (16) in
                    the chunk form, 0 in the recurrent one; TTT-MLP and Titans (MLP) add 2*Dh*V for the
                    backprop to the hidden layer, Dh = 4K (LayerNorm, GELU and the momentum not counted)
"""

TARGET_T = 16384
FAMILIES = ("linear", "delta", "delta-variants", "feedback", "test-time", "softmax", "ssd", "peer")
DEFAULT_FAMILIES = FAMILIES[:-1]  # "peer" (flash-linear-attention's PyTorch chunk functions) only when asked
MODES = ("chunk", "recurrent")
PASSES = ("fwd", "fwdbwd")
PASS_LABEL = {"fwd": "fwd", "fwdbwd": "fwd+bwd"}
BACKENDS = ("auto", "torch", "triton", "cpu")
# thresholds at T = 16384 (x softmax time / op time; the matmul fraction), by --targets: "15" the PyTorch forms',
# "34" the compiled CPU kernels'; the delta ops' "rec" is their chunk-over-recurrent target (None: none)
TARGET_SETS = {
    "15": {"linear": (30.0, 25.0, 0.40), "deltanet": (15.0, 10.0), "gated_deltanet": (15.0, 10.0), "efla": (15.0, 10.0),
           "rec": 20.0},
    "34": {"linear": (40.0, 40.0, 0.45), "deltanet": (20.0, 20.0), "gated_deltanet": (15.0, 15.0), "efla": (20.0, 20.0),
           "rec": None},
}
SMALL_T = 1024  # the compiled CPU kernels' target: at this T never slower than the PyTorch forms
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}
DEFAULT_T = [1024, 2048, 4096, 8192, 16384, 32768, 65536]
DEFAULT_MAX_T_SOFTMAX_CPU = 32768
DP_HOUSEHOLDER = 2  # delta_product's keys per token in the benchmark
TT_MINI_BATCH = 16  # ttt / titans: tokens per inner gradient step (the TTT paper's value)
TT_HIDDEN = 4       # ttt-mlp / titans: inner MLP width = TT_HIDDEN * K
MESA_ITERS = 30     # mesa_net: CG iterations (its default max_iter; tol=0, so all of them run)
MAMBA2_GROUPS = 1   # mamba2's SSD row: B and C groups shared by the H value heads (Mamba2's default n_groups)


@dataclass(frozen=True)
class BenchOp:
    """One operator row of `bench ops`, everything about it in one place (registered with `register_bench_op`).

    inputs(randn, B, T, H, K, V) -> named fp32 tensors, drawn as the op's layer makes them (`randn(*shape)` is the
        case's seeded generator); the case moves them to its dtype and device.
    call(x, mode, chunk_size) -> (operator name, function, positional args, keyword args): one call of the op.
    flops(mode, B, T, H, K, V, C) -> the nominal forward flop count (C: the chunk size really used; DESCRIPTION).
    chunk: how the chunk size a chunk-form row really runs with is found: "op" asks the operator
        (`linattn.ops.chunk_size_used` with the call's arguments), "block" is min(--chunk-size, T) (the softmax
        side's block_size), an int is fixed, None means no chunk.
    backend: the op takes `backend=` (--backends runs it once per backend).
    """
    key: str
    family: str
    label: str
    modes: Tuple[str, ...]
    inputs: Callable[..., Dict[str, torch.Tensor]]
    call: Callable[[Dict[str, torch.Tensor], str, int], Tuple[str, Callable, tuple, Dict[str, Any]]]
    flops: Callable[..., float]
    color: str = "C0"
    chunk: Any = "op"
    backend: bool = False


BENCH_OPS: Dict[str, BenchOp] = {}


def register_bench_op(op: BenchOp) -> BenchOp:
    """Add a row to `bench ops` (in registration order; the key names it in the results and --families filters it)."""
    if op.key in BENCH_OPS:
        raise ValueError(f"bench op {op.key!r} is already registered")
    if op.family not in FAMILIES:
        raise ValueError(f"bench op {op.key!r}: family must be one of {FAMILIES}, got {op.family!r}")
    BENCH_OPS[op.key] = op
    return op


def _unit(x: torch.Tensor) -> torch.Tensor:
    return F.normalize(x, dim=-1)


# -- flop counts (DESCRIPTION's conventions) ---------------------------------------------------------------------

def _linear_flops(mode, B, T, H, K, V, C):
    return 4.0 * B * H * T * K * (C + V) if mode == "chunk" else 4.0 * B * H * T * K * V


def _delta_flops(mode, B, T, H, K, V, C, steps=1):
    T = T * steps   # DeltaProduct and RWKV-7 run the core over several sub-steps per token (C counts sub-steps)
    return B * H * T * (6.0 * C * K + 4.0 * C * V + 6.0 * K * V) if mode == "chunk" else 6.0 * B * H * T * K * V


def _feedback_flops(mode, B, T, H, K, V, C, factor=1.0, path=False):
    return B * H * T * (T + C) * (K + V) * factor + (2.0 * B * H * T * T * K if path else 0.0)


def _test_time_flops(op: str, mode: str, B, T, H, K, V, C) -> float:
    if op == "mesanet":
        n_it = MESA_ITERS
        if mode == "chunk":
            return B * H * T * (n_it * (4.0 * C * K + 2.0 * K * K) + 2.0 * K * (K + V) + 2.0 * C * (K + V)
                                + 2.0 * K * V)
        return B * H * T * (2.0 * K * (K + V) + 2.0 * n_it * K * K + 2.0 * K * V)
    M = C if mode == "chunk" else 0
    Dh = TT_HIDDEN * K
    layers = [(K, V)] if op == "ttt_linear" else [(K, Dh), (Dh, V)]
    f = sum(6.0 * a * b + 2.0 * M * (a + b) for a, b in layers) + (0.0 if op == "ttt_linear" else 2.0 * Dh * V)
    return B * H * T * f


# -- linear attention ----------------------------------------------------------------------------------------------

def _linear_inputs(randn, B, T, H, K, V):
    return {"q": randn(B, T, H, K), "k": randn(B, T, H, K), "v": randn(B, T, H, V)}


register_bench_op(BenchOp(
    "linear", "linear", "linear elu+1", MODES, _linear_inputs,
    lambda x, mode, C: ("linear_attention", linear_attention, (x["q"], x["k"], x["v"]), dict(
        feature_map="elu+1", causal=True, normalize=True, mode=mode, chunk_size=C)),
    _linear_flops, color="C0", backend=True))


def _ssd_inputs(randn, B, T, H, K, V):
    """Mamba2's SSD as its block calls it: C (q) and B (k) in one group shared by the H value heads, x * dt (v),
    the log-decay dt * A per value head (dt = softplus(N(0, 1) - 4), A in (-16, -1), as at initialisation)."""
    q, k, x = randn(B, T, MAMBA2_GROUPS, K), randn(B, T, MAMBA2_GROUPS, K), randn(B, T, H, V)
    dt = F.softplus(randn(B, T, H) - 4.0)
    a = -(1.0 + 15.0 * torch.sigmoid(randn(H)))
    return {"q": q, "k": k, "v": x * dt[..., None], "g": dt * a}


def _ssd_flops(mode, B, T, H, K, V, C):
    """q.k^T once per group within chunks; per value head A.v within chunks, k^T v and q.S across."""
    if mode != "chunk":
        return 4.0 * B * H * T * K * V
    return 2.0 * B * MAMBA2_GROUPS * T * C * K + B * H * T * (2.0 * C * V + 4.0 * K * V)


register_bench_op(BenchOp(
    "mamba2_ssd", "ssd", f"Mamba2 SSD (G={MAMBA2_GROUPS})", MODES, _ssd_inputs,
    lambda x, mode, C: ("linear_attention", linear_attention, (x["q"], x["k"], x["v"]), dict(
        feature_map=None, normalize=False, g=x["g"], scale=1.0, mode=mode, chunk_size=C)),
    _ssd_flops, color="C9", backend=True))


# -- the delta rule and its variants ------------------------------------------------------------------------------

def _delta_inputs(gated: bool, exact: bool):
    def inputs(randn, B, T, H, K, V):
        q, k, v = randn(B, T, H, K), randn(B, T, H, K), randn(B, T, H, V)
        x = {"beta": torch.sigmoid(randn(B, T, H))}
        if gated:
            x["g"] = -F.softplus(randn(B, T, H)) / 16
        # DeltaNet: L2-normalised keys; EFLA uses the raw key norm
        return dict(x, q=_unit(q), k=k if exact else _unit(k), v=v)
    return inputs


def _delta_call(exact: bool):
    return lambda x, mode, C: ("delta_rule", delta_rule, (x["q"], x["k"], x["v"], x["beta"]), dict(
        g=x.get("g"), exact=exact, mode=mode, chunk_size=C))


for _key, _label, _gated, _exact, _color in (("deltanet", "DeltaNet", False, False, "C1"),
                                             ("gated_deltanet", "Gated DeltaNet", True, False, "C2"),
                                             ("efla", "EFLA", False, True, "C3")):
    register_bench_op(BenchOp(_key, "delta", _label, MODES, _delta_inputs(_gated, _exact), _delta_call(_exact),
                              _delta_flops, color=_color, backend=True))


def _variant_inputs(key: str):
    """L2-normalised q and k, beta = sigmoid, gates as Gated DeltaNet's (KDA: per key channel)."""
    def inputs(randn, B, T, H, K, V):
        q, k, v = randn(B, T, H, K), randn(B, T, H, K), randn(B, T, H, V)
        n = DP_HOUSEHOLDER if key == "delta_product" else 1
        if key == "delta_product":
            k, v = randn(B, T, H, n, K), randn(B, T, H, n, V)
        x = {"beta": torch.sigmoid(randn(B, T, H, n) if key == "delta_product" else randn(B, T, H))}
        if key == "comba":
            x["g"] = -F.softplus(randn(B, T, H)) / 16
        elif key == "kda":
            x["g"] = -F.softplus(randn(B, T, H, K)) / 16     # per key channel
        return dict(x, q=_unit(q), k=_unit(k), v=v)
    return inputs


def _variant_call(name: str, fn: Callable):
    return lambda x, mode, C: (name, fn, (x["q"], x["k"], x["v"], x["beta"]), dict(g=x.get("g"), mode=mode,
                                                                                   chunk_size=C))


register_bench_op(BenchOp("comba", "delta-variants", "Comba", MODES, _variant_inputs("comba"),
                          _variant_call("comba", comba), _delta_flops, color="C4", backend=True))
register_bench_op(BenchOp("delta_product", "delta-variants", f"DeltaProduct n={DP_HOUSEHOLDER}", MODES,
                          _variant_inputs("delta_product"), _variant_call("delta_product", delta_product),
                          lambda *a: _delta_flops(*a, steps=DP_HOUSEHOLDER), color="C5", backend=True))
register_bench_op(BenchOp("kda", "delta-variants", "KDA", MODES, _variant_inputs("kda"),
                          _variant_call("delta_rule", delta_rule), _delta_flops, color="C6", backend=True))


def _rwkv7_inputs(randn, B, T, H, K, V):
    """As the RWKV-7 layer makes them: w in (-exp(-1/2), 0), a = -kk, b = kk * sigmoid (kk unit)."""
    q, k, v = randn(B, T, H, K), randn(B, T, H, K), randn(B, T, H, V)
    kk = _unit(randn(B, T, H, K))
    return {"w": -0.6065306597126334 * torch.sigmoid(randn(B, T, H, K)), "a": -kk,
            "b": kk * torch.sigmoid(randn(B, T, H, K)), "q": q, "k": k, "v": v}


register_bench_op(BenchOp(
    "rwkv7", "delta-variants", "RWKV-7", MODES, _rwkv7_inputs,   # chunk_size in tokens; 2 core sub-steps per token
    lambda x, mode, C: ("rwkv7", rwkv7, (x["q"], x["w"], x["k"], x["v"], x["a"], x["b"]), dict(
        mode=mode, chunk_size=C)),
    lambda *a: _delta_flops(*a, steps=2), color="C7", backend=True))


# -- "feedback": softmax attention fed back by linear attention (chunk form only: the decoding step is a Python loop
# over tokens of O(T) attention steps) --------------------------------------------------------------------------

def _feedback_inputs(extra: Callable):
    def inputs(randn, B, T, H, K, V):
        q, k, v = randn(B, T, H, K), randn(B, T, H, K), randn(B, T, H, V)
        return dict(extra(randn, B, T, H, K), q=q, k=k, v=v)
    return inputs


def _feedback_call(name: str, fn: Callable, names: Tuple[str, ...]):
    return lambda x, mode, C: (name, fn, tuple(x[n] for n in names), dict(mode=mode, block_size=C))


register_bench_op(BenchOp(
    "fox", "feedback", "FoX", ("chunk",),
    _feedback_inputs(lambda randn, B, T, H, K: {"g": F.logsigmoid(randn(B, T, H) + 2.0)}),
    _feedback_call("forgetting_attention", forgetting_attention, ("q", "k", "v", "g")),
    _feedback_flops, color="C7", chunk="block"))
register_bench_op(BenchOp(
    "deltaformer", "feedback", "DeltaFormer", ("chunk",),
    _feedback_inputs(lambda randn, B, T, H, K: {"beta": torch.sigmoid(randn(B, T, H))}),
    _feedback_call("deltaformer", deltaformer, ("q", "k", "v", "beta")),
    lambda *a: _feedback_flops(*a, factor=2.0), color="C8", chunk="block"))
register_bench_op(BenchOp(
    "path", "feedback", "PaTH", ("chunk",),
    _feedback_inputs(lambda randn, B, T, H, K: {"w": _unit(randn(B, T, H, K)),
                                                 "beta": 2 * torch.sigmoid(randn(B, T, H))}),
    _feedback_call("path_attention", path_attention, ("q", "k", "v", "w", "beta")),
    lambda *a: _feedback_flops(*a, path=True), color="C9", chunk="block"))


# -- "test-time": MesaNet (solver="cg", max_iter=30), TTT-Linear, TTT-MLP (hidden 4K), Titans (MLP memory);
# mini_batch = TT_MINI_BATCH, a model hyper-parameter, not --chunk-size ----------------------------------------

def _test_time_inputs(op: str):
    """As the layers at initialisation."""
    def inputs(randn, B, T, H, K, V):
        q, k, v = randn(B, T, H, K), randn(B, T, H, K), randn(B, T, H, V)
        if op in ("mesanet", "titans"):
            q, k = _unit(q), _unit(k)
        x: Dict[str, torch.Tensor] = {}
        if op == "mesanet":
            x.update(beta=torch.sigmoid(randn(B, T, H)), g=F.logsigmoid(randn(B, T, H)), lam=torch.ones(H, K))
            return dict(x, q=q, k=k, v=v)
        x["lr"] = torch.sigmoid(randn(B, T, H)) / K * (1.0 if op == "ttt_linear" else 0.1)
        if op == "titans":
            x["alpha"] = torch.sigmoid(randn(B, T, H) - 4.0)
            x["momentum"] = torch.sigmoid(randn(B, T, H))
        if op == "ttt_linear":
            x["W"], x["b"] = 0.02 * randn(H, K, V), torch.zeros(H, V)
        else:
            Dh = TT_HIDDEN * K
            x["W1"], x["b1"] = 0.02 * randn(H, K, Dh), torch.zeros(H, Dh)
            x["W2"], x["b2"] = 0.02 * randn(H, Dh, V), torch.zeros(H, V)
        return dict(x, q=q, k=k, v=v)
    return inputs


def _test_time_call(op: str):
    def call(x, mode, C):
        if op == "mesanet":
            return "mesa_net", mesa_net, (x["q"], x["k"], x["v"], x["beta"], x["g"], x["lam"]), dict(
                mode=mode, chunk_size=C, max_iter=MESA_ITERS, tol=0.0)
        if op == "ttt_linear":
            kw = dict(inner="linear", initial_state=(x["W"], x["b"]))
        else:
            kw = dict(inner="mlp", initial_state=(x["W1"], x["b1"], x["W2"], x["b2"]))
        kw.update(mode=mode, mini_batch=TT_MINI_BATCH)
        if op == "titans":
            return "titans", titans, (x["q"], x["k"], x["v"], x["lr"], x["alpha"], x["momentum"]), kw
        return "ttt", ttt, (x["q"], x["k"], x["v"], x["lr"]), kw
    return call


for _key, _label, _color in (("mesanet", "MesaNet (CG)", "C0"), ("ttt_linear", "TTT-Linear", "C1"),
                             ("ttt_mlp", "TTT-MLP", "C2"), ("titans", "Titans (MLP)", "C3")):
    register_bench_op(BenchOp(_key, "test-time", _label, MODES, _test_time_inputs(_key), _test_time_call(_key),
                              lambda mode, *a, _op=_key: _test_time_flops(_op, mode, *a), color=_color))


register_bench_op(BenchOp(
    "softmax", "softmax", "softmax (SDPA)", ("sdpa",), _linear_inputs,
    lambda x, mode, C: ("softmax_attention", softmax_attention, (x["q"], x["k"], x["v"]), dict(causal=True)),
    lambda mode, B, T, H, K, V, C: 2.0 * B * H * T * T * (K + V), color="k", chunk=None))


# -- "peer": flash-linear-attention's pure-PyTorch chunk functions (fla.ops.*.naive), when installed; never a
# dependency of linattn, imported only when these rows run ----------------------------------------------------------
PEER_CHUNK = 64  # the chunk size of FLA's naive chunk functions (linear attention's is fixed at 64)


def peer_unavailable(T: int, key: str = "fla_linear") -> Optional[str]:
    """Why the peer row `key` cannot run (None when it can): flash-linear-attention's naive chunk functions, or
    transformers' Gated DeltaNet fallback (row hf_gated_deltanet)."""
    if key == HF_GDN:
        try:
            from ..hf.kernelize import torch_fallback_function
            torch_fallback_function("torch_chunk_gated_delta_rule")
        except Exception as e:  # transformers is optional
            return f"transformers' torch_chunk_gated_delta_rule cannot be imported ({type(e).__name__}: {e})"
        return None
    try:
        import fla.ops.delta_rule.naive  # noqa: F401
        import fla.ops.linear_attn.naive  # noqa: F401
    except Exception as e:  # not installed, or its import fails on this machine
        return f"flash-linear-attention's naive chunk functions cannot be imported ({type(e).__name__}: {e})"
    if T % PEER_CHUNK:
        return f"FLA's naive chunk functions need T % {PEER_CHUNK} == 0"
    return None


def _fla_linear_call(x, mode, C):
    """elu+1 features computed first, normalised, scale 1 (the linear row's inputs)."""
    from fla.ops.linear_attn.naive import naive_chunk_linear_attn

    def run(q, k, v):
        return naive_chunk_linear_attn(F.elu(q) + 1, F.elu(k) + 1, v, scale=1.0, normalize=True)
    return "fla naive_chunk_linear_attn", run, (x["q"], x["k"], x["v"]), {}


def _fla_delta_call(x, mode, C):
    """DeltaNet in fla's [B, H, T, D] layout, chunk 64 (the deltanet row's inputs)."""
    from fla.ops.delta_rule.naive import delta_rule_chunkwise

    def run_delta(q, k, v, beta):
        o, _ = delta_rule_chunkwise(*(t.transpose(1, 2) for t in (q, k, v, beta)), chunk_size=PEER_CHUNK)
        return o.transpose(1, 2)
    return "fla delta_rule_chunkwise", run_delta, (x["q"], x["k"], x["v"], x["beta"]), {}


register_bench_op(BenchOp("fla_linear", "peer", "FLA naive linear elu+1", ("chunk",), _linear_inputs,
                          _fla_linear_call, _linear_flops, color="C8", chunk=PEER_CHUNK))
register_bench_op(BenchOp("fla_deltanet", "peer", "FLA naive DeltaNet", ("chunk",), _delta_inputs(False, False),
                          _fla_delta_call, _delta_flops, color="C9", chunk=PEER_CHUNK))

# transformers' own PyTorch fallback of Gated DeltaNet (Qwen3-Next / Qwen3.5), on the gated_deltanet row's inputs
# (unit q and k, so no in-kernel L2 norm; its default scale 1/sqrt(K) is delta_rule's): the target "Gated
# DeltaNet forward >= 3x transformers' torch_chunk_gated_delta_rule at T = 2048"
HF_GDN = "hf_gated_deltanet"
HF_GDN_T = 2048


def _hf_gdn_call(x, mode, C):
    from ..hf.kernelize import torch_fallback_function

    # the function itself, not fla's kernel that transformers binds behind it when fla is installed
    torch_chunk_gated_delta_rule = torch_fallback_function("torch_chunk_gated_delta_rule")

    def run_hf(q, k, v, g, beta):
        return torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=PEER_CHUNK)[0]
    return "transformers torch_chunk_gated_delta_rule", run_hf, (x["q"], x["k"], x["v"], x["g"], x["beta"]), {}


register_bench_op(BenchOp(HF_GDN, "peer", "transformers Gated DeltaNet", ("chunk",), _delta_inputs(True, False),
                          _hf_gdn_call, _delta_flops, color="C6", chunk=PEER_CHUNK))

OPS: Tuple[BenchOp, ...] = tuple(BENCH_OPS.values())
OP_BY_KEY = BENCH_OPS


# ----------------------------------------------------------------------------------------------
# Cases: one (op, mode, pass, shape) -> a zero-argument callable. Also the memory worker's builder.
# ----------------------------------------------------------------------------------------------

def _make_inputs(op: BenchOp, B, T, H, K, V, dtype, device, seed) -> Dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    x = op.inputs(randn, B, T, H, K, V)
    return {name: t.to(device=device, dtype=dtype).contiguous() for name, t in x.items()}


def _case(op: str, mode: str, pass_: str, B: int, T: int, H: int, K: int, V: int, dtype: str, device: str,
          chunk_size: int, seed: int, backend: Optional[str] = None
          ) -> Tuple[Dict[str, torch.Tensor], str, Callable, tuple, Dict[str, Any]]:
    """One case's inputs (requiring grad for fwdbwd) and its operator call: (inputs, op name, op,
    positional args, keyword args). backend: passed to the operators that take one (None: their default)."""
    opd = OP_BY_KEY[op]
    x = _make_inputs(opd, B, T, H, K, V, DTYPES[dtype], device, seed)
    if pass_ != "fwd":
        for t in x.values():
            t.requires_grad_(True)
    name, fn, args, kwargs = opd.call(x, mode, chunk_size)
    if backend is not None and opd.backend:
        kwargs = {**kwargs, "backend": backend}
    return x, name, fn, args, kwargs


def build_case(op: str, mode: str, pass_: str, B: int, T: int, H: int, K: int, V: int,
               dtype: str = "float32", device: str = "cpu", chunk_size: int = 64, seed: int = 0,
               backend: Optional[str] = None):
    """A zero-argument callable that runs one case once (inputs are made here, outside the timing).

    fwd: the op under torch.no_grad(). fwdbwd: the op with autograd, then backward of a fixed random
    output gradient into every float input (q, k, v, and beta, g for the delta rule).
    """
    x, _, op_fn, args, kwargs = _case(op, mode, pass_, B, T, H, K, V, dtype, device, chunk_size, seed, backend)

    def call() -> torch.Tensor:
        out = op_fn(*args, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    if pass_ == "fwd":
        def fn():
            with torch.no_grad():
                call()
        return fn
    leaves = list(x.values())
    do = torch.randn(B, T, H, V, generator=torch.Generator().manual_seed(seed + 1)).to(device=device,
                                                                                      dtype=DTYPES[dtype])

    def fn():
        for t in leaves:
            t.grad = None
        call().backward(do)
    return fn


def case_chunk_size(op: str, mode: str, pass_: str, B: int, T: int, H: int, K: int, V: int,
                    dtype: str = "float32", device: str = "cpu", chunk_size: int = 64, seed: int = 0,
                    backend: Optional[str] = None) -> Optional[int]:
    """The chunk size a chunk-form case really runs with (None for the other forms): see `BenchOp.chunk`."""
    how = OP_BY_KEY[op].chunk
    if mode != "chunk" or how is None:
        return None
    if how == "block":   # block_size as asked, capped at T (one block)
        return min(chunk_size, T)
    if isinstance(how, int):
        return how
    _, name, _, args, kwargs = _case(op, mode, pass_, B, T, H, K, V, dtype, device, chunk_size, seed, backend)
    return chunk_size_used(name, *args, **kwargs)   # MesaNet: its chunk size; TTT / Titans: the mini-batch


def flops(op: str, mode: str, pass_: str, B, T, H, K, V, C) -> float:
    """Nominal flop count of one call (see DESCRIPTION for the conventions)."""
    f = OP_BY_KEY[op].flops(mode, B, T, H, K, V, C)
    return 3.0 * f if pass_ == "fwdbwd" else f


# ----------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------

def _csv(choices: Sequence[str]):
    def parse(text: str) -> List[str]:
        items = [s.strip() for s in text.split(",") if s.strip()]
        bad = [s for s in items if s not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated subset of {','.join(choices)}, got {text!r}")
        return list(dict.fromkeys(items))
    parse.__name__ = "list"
    return parse


def add_arguments(p) -> None:
    """The options of `linattn bench ops`.

    Args:
        p: The argparse parser to add them to.
    """
    p.add_argument("--T", type=int, nargs="+", default=DEFAULT_T, metavar="T",
                   help="sequence lengths (default 1024 ... 65536, powers of two)")
    p.add_argument("--B", type=int, default=1, help="batch size (default 1)")
    p.add_argument("--H", type=int, default=4, help="heads (default 4)")
    p.add_argument("--K", type=int, default=64, help="query/key head dim (default 64)")
    p.add_argument("--V", type=int, default=64, help="value head dim (default 64)")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32", help="(default float32)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default cpu)")
    p.add_argument("--families", type=_csv(FAMILIES), default=list(DEFAULT_FAMILIES),
                   help=f"comma-separated subset of {','.join(FAMILIES)} (default all but peer; delta-variants: "
                        f"Comba, DeltaProduct with n={DP_HOUSEHOLDER}, KDA, RWKV-7; ssd: Mamba2's SSD; "
                        f"peer: flash-linear-attention's pure-PyTorch chunk functions and transformers' "
                        f"torch_chunk_gated_delta_rule, when installed; with --targets 34 and the delta family, the "
                        f"Gated DeltaNet forward at T={HF_GDN_T} is checked against transformers' (>= 3x))")
    p.add_argument("--modes", type=_csv(MODES), default=list(MODES),
                   help="forms of linear and delta: chunk,recurrent (default both)")
    p.add_argument("--passes", type=_csv(PASSES), default=list(PASSES),
                   help="fwd (under no_grad) and/or fwdbwd (default both)")
    p.add_argument("--backends", type=_csv(BACKENDS), default=["auto"],
                   help="comma-separated backends of the operators that take one (linear attention, the delta rule "
                        "and its variants): each such case runs once per backend, interleaved, rows labelled "
                        "[backend], with the speed-up over the first one listed (e.g. torch,cpu; default auto)")
    p.add_argument("--targets", choices=sorted(TARGET_SETS), default="15",
                   help="which issue's targets to check: 15 (the PyTorch forms, default) or 34 (the compiled CPU "
                        "kernels: linear >= 40x softmax fwd and fwd+bwd and >= 45%% of the matmul rate, DeltaNet / "
                        "EFLA >= 20x, Gated DeltaNet >= 15x; with --backends torch,cpu also cpu never slower than "
                        f"torch at T = {SMALL_T})")
    p.add_argument("--chunk-size", type=int, default=64,
                   help="chunk size asked of the chunk forms (default 64); a backend may use another one, "
                        "which is then what is printed, recorded and counted")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per case (default 5; adapted, see --budget)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls before timing (default 1)")
    p.add_argument("--min-time", type=float, default=0.2,
                   help="repeat short calls until this many seconds were timed (default 0.2)")
    p.add_argument("--budget", type=float, default=30.0,
                   help="seconds of timed calls per case; long calls get fewer repeats, at least "
                        "min(repeats, 3) unless one call exceeds the budget (default 30)")
    p.add_argument("--no-interleave", dest="interleave", action="store_false",
                   help="time each case in one block instead of interleaving the cases of a T in rounds "
                        "(interleaving keeps ratios fair when other processes share the machine)")
    p.add_argument("--max-T-softmax", type=int, default=None,
                   help=f"largest T for softmax_attention; 0 = no cap (default {DEFAULT_MAX_T_SOFTMAX_CPU} "
                        f"on cpu, no cap on cuda)")
    p.add_argument("--max-T-recurrent", type=int, default=16384,
                   help="largest T for the recurrent forms, forward (default 16384)")
    p.add_argument("--max-T-recurrent-bwd", type=int, default=1024,
                   help="largest T for the recurrent forms, forward+backward (a Python loop over tokens: "
                        "slow, and its backward keeps every step's state; no target uses it; default 1024)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    p.add_argument("--matmul-n", type=int, default=2048, help="size of the reference matmul (default 2048)")
    p.add_argument("--threads", type=int_at_least(0), default=None,
                   help="torch.set_num_threads for the timings (default and 0: torch's default)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--out", default=None, help="output folder (default results/bench/ops/)")
    p.add_argument("--name", default="ops", help="file name stem of the outputs (default ops)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace existing output files (default: write a new timestamped name instead)")
    p.add_argument("--quiet", action="store_true", help="no per-case progress on stderr")


def _validate(a) -> None:
    prog = "linattn bench ops"
    if any(t < 1 for t in a.T):
        raise UsageError(f"--T: sequence lengths must be >= 1, got {a.T}", prog)
    for name in ("B", "H", "K", "V", "chunk_size", "repeats", "matmul_n"):
        if getattr(a, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}", prog)
    if a.warmup < 0:
        raise UsageError(f"--warmup must be >= 0, got {a.warmup}", prog)
    if a.budget <= 0 or a.min_time < 0:
        raise UsageError("--budget must be > 0 and --min-time >= 0", prog)
    for name in ("max_T_softmax", "max_T_recurrent", "max_T_recurrent_bwd"):
        val = getattr(a, name)
        if val is not None and val < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 0 (0 = no cap), got {val}", prog)
    try:
        dev = torch.device(a.device)
    except RuntimeError as e:
        raise UsageError(f"--device: {e}", prog) from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {a.device}: CUDA is not available", prog)
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"--device must be cpu or cuda[:i], got {a.device!r}", prog)
    if "/" in a.name or not a.name:
        raise UsageError(f"--name must be a plain file name stem, got {a.name!r}", prog)


def _cap(val: Optional[int]) -> Optional[int]:
    return None if val in (None, 0) else val


# ----------------------------------------------------------------------------------------------
# The benchmark
# ----------------------------------------------------------------------------------------------

def _plan(a):
    """The cases to run, and the skipped ones with their reasons (nothing is extrapolated)."""
    cases, skipped = [], []
    max_sm = _cap(a.max_T_softmax if a.max_T_softmax is not None
                  else (None if a.device.startswith("cuda") else DEFAULT_MAX_T_SOFTMAX_CPU))
    max_rec, max_rec_bwd = _cap(a.max_T_recurrent), _cap(a.max_T_recurrent_bwd)
    for T in sorted(set(a.T)):
        for op in OPS:
            if op.family not in a.families:
                continue
            modes = [m for m in op.modes if m in a.modes] if op.family != "softmax" else ["sdpa"]
            for mode in modes:
                for ps in a.passes:
                    for backend in _backends(a, op):
                        _plan_one(a, {"T": T, "op": op.key, "mode": mode, "pass": ps, "backend": backend}, op,
                                  mode, ps, T, max_sm, max_rec, max_rec_bwd, cases, skipped)
    return cases, skipped, {"softmax": max_sm, "recurrent": max_rec, "recurrent_bwd": max_rec_bwd}


def _backends(a, op: BenchOp) -> List[Optional[str]]:
    """The backends a case runs on: each of --backends for the operators that take one; None (the operator's
    default, unlabelled) for the others, and for everything when --backends is just auto."""
    chosen = list(getattr(a, "backends", None) or ["auto"])
    if chosen == ["auto"] or not op.backend:
        return [None]
    return chosen


def _plan_one(a, rec, op, mode, ps, T, max_sm, max_rec, max_rec_bwd, cases, skipped) -> None:
    """Add one case to `cases`, or to `skipped` with the reason."""
    peer_missing = peer_unavailable(T, op.key) if op.family == "peer" else None
    if peer_missing is not None:
        skipped.append({**rec, "reason": peer_missing})
    elif op.family == "softmax" and max_sm is not None and T > max_sm:
        skipped.append({**rec, "reason": f"T > --max-T-softmax={max_sm} (O(T^2); not run, not extrapolated)"})
    elif mode == "recurrent" and ps == "fwd" and max_rec is not None and T > max_rec:
        skipped.append({**rec, "reason": f"T > --max-T-recurrent={max_rec}"})
    elif mode == "recurrent" and ps == "fwdbwd" and max_rec_bwd is not None and T > max_rec_bwd:
        skipped.append({**rec, "reason": f"T > --max-T-recurrent-bwd={max_rec_bwd}"})
    else:
        cases.append(rec)


def _spec(a, c) -> Dict[str, Any]:
    return {"op": c["op"], "mode": c["mode"], "pass_": c["pass"], "B": a.B, "T": c["T"], "H": a.H,
            "K": a.K, "V": a.V, "dtype": a.dtype, "device": a.device, "chunk_size": a.chunk_size,
            "seed": a.seed, "backend": c.get("backend")}


def _label(r) -> str:
    op = OP_BY_KEY[r["op"]]
    tag = f" [{r['backend']}]" if r.get("backend") else ""
    return op.label if op.family == "softmax" else f"{op.label} {r['mode']}{tag}"


def run_cases(a, cases, log) -> List[Dict[str, Any]]:
    """Time every case (interleaved within each T unless --no-interleave); then, unless --no-memory,
    measure peak memory in one separate process."""
    results = []
    for T in sorted({c["T"] for c in cases}):
        group = [c for c in cases if c["T"] == T]
        gc.collect()  # once per T: a full collection is not free on a busy machine
        for c in group:
            if c["mode"] == "chunk":
                c["chunk_size"] = a.chunk_size
                try:
                    c["chunk_size_used"] = case_chunk_size(**_spec(a, c))
                except Exception as e:  # unknown: no flop count is claimed for this row
                    c["chunk_size_used"] = None
                    c["chunk_size_error"] = f"{type(e).__name__}: {' '.join(str(e).split())}"
        if a.interleave:
            log(f"  T={T:<6} timing {len(group)} cases, interleaved ...")
            timings = common.time_interleaved(
                [lambda c=c: build_case(**_spec(a, c)) for c in group], warmup=a.warmup, repeats=a.repeats,
                min_time_s=a.min_time, budget_s=a.budget, device=a.device)
        else:
            timings = []
            for c in group:
                try:
                    timings.append(common.time_fn(build_case(**_spec(a, c)), warmup=a.warmup, repeats=a.repeats,
                                                  min_time_s=a.min_time, budget_s=a.budget, device=a.device))
                except Exception as e:  # an op that fails (or runs out of memory) is reported, not fatal
                    timings.append(e)
        for c, t in zip(group, timings):
            r = dict(c)
            name = f"  T={c['T']:<6} {_label(r):<34} {PASS_LABEL[c['pass']]:<7}"
            if isinstance(t, Exception):
                r["error"] = f"{type(t).__name__}: {' '.join(str(t).split())}"
                log(f"{name} FAILED: {r['error']}")
            else:
                r["timing"] = t.to_dict()
                r["ms"] = t.median_ms
                log(f"{name} {common.fmt_ms(t.median_ms):>9} ms (n={t.repeats})")
            results.append(r)
    measured = [r for r in results if "error" not in r]
    if measured and not a.no_memory:
        log(f"peak memory of {len(measured)} cases, one call each (separate process) ...")
        specs = [_spec(a, r) for r in measured]
        warm = [{**sp, "T": min(sp["T"], 256)} for sp in specs]  # warm-up at a small size saves time
        mem = common.measure_memory("linattn.bench.ops:build_case", specs, a.device, warmup_specs=warm)
        for r, m in zip(measured, mem):
            r["peak_bytes"] = m["peak_bytes"]
            if m["error"]:
                r["memory_error"] = m["error"]
    return results


def derive(results, a, matmul_gflops: float) -> None:
    """Add flops, GFLOP/s, fraction of the matmul rate, and speed-ups to each measured row."""
    by = {(r["T"], r["op"], r["mode"], r["pass"], r.get("backend")): r for r in results if "ms" in r}
    first = (getattr(a, "backends", None) or [None])[0]
    for r in by.values():
        C = r.get("chunk_size_used")  # only the chunk forms' counts depend on C: the size really used
        if r["mode"] == "chunk" and C is None:
            r["flops"] = r["gflops"] = r["matmul_fraction"] = None  # unknown chunk size: no flop count
        else:
            f = flops(r["op"], r["mode"], r["pass"], a.B, r["T"], a.H, a.K, a.V, C or 0)
            r["flops"] = f
            r["gflops"] = f / (r["ms"] * 1e-3) / 1e9
            r["matmul_fraction"] = r["gflops"] / matmul_gflops if matmul_gflops else None
        sm = by.get((r["T"], "softmax", "sdpa", r["pass"], None))
        r["speedup_vs_softmax"] = sm["ms"] / r["ms"] if sm is not None else None
        rec = by.get((r["T"], r["op"], "recurrent", r["pass"], r.get("backend"))) if r["mode"] == "chunk" else None
        r["speedup_vs_recurrent"] = rec["ms"] / r["ms"] if rec is not None else None
        base = by.get((r["T"], r["op"], r["mode"], r["pass"], first)) if r.get("backend") else None
        r["speedup_vs_first_backend"] = base["ms"] / r["ms"] if base is not None else None


def _x(v: Optional[float]) -> str:
    if v is None:
        return "-"
    return f"{v:.1f}x" if v < 100 else f"{v:.0f}x"


def _chunk_cell(r) -> str:
    """The chunk size a row ran with; '*' marks one that differs from the requested size."""
    used = r.get("chunk_size_used")
    if used is None:
        return "-"
    return f"{used}*" if used != r.get("chunk_size") else str(used)


def chunk_sizes_used(results) -> Dict[str, List[int]]:
    """The chunk sizes each operator's chunk form really ran with, by op key."""
    used: Dict[str, List[int]] = {}
    for r in results:
        if r.get("chunk_size_used") is not None:
            used.setdefault(r["op"], [])
            if r["chunk_size_used"] not in used[r["op"]]:
                used[r["op"]].append(r["chunk_size_used"])
    return {op: sorted(v) for op, v in used.items()}


def chunk_line(requested: int, used: Dict[str, List[int]]) -> str:
    parts = [f"{OP_BY_KEY[op].label} {'/'.join(map(str, sizes))}" for op, sizes in used.items()]
    return f"chunk    --chunk-size {requested}; used by the chunk forms: " + (", ".join(parts) or "none ran")


def results_table(results) -> str:
    backends = [r["backend"] for r in results if r.get("backend")]
    first = backends[0] if backends and len(set(backends)) > 1 else None  # a column only when backends compare
    rows = []
    for r in results:
        head = [r["T"], _label(r), PASS_LABEL[r["pass"]], _chunk_cell(r)]
        if "ms" not in r:
            rows.append(head + ["FAILED", r.get("error", "")[:60]] + [""] * (7 if first else 6))
            continue
        t = r["timing"]
        rows.append(head + [
            common.fmt_ms(r["ms"]), f"{common.fmt_ms(t['q1_ms'])}-{common.fmt_ms(t['q3_ms'])}", t["repeats"],
            _x(r.get("speedup_vs_softmax")), _x(r.get("speedup_vs_recurrent")),
            f"{r['gflops']:.1f}" if r.get("gflops") is not None else "-",
            f"{100 * r['matmul_fraction']:.1f}" if r.get("matmul_fraction") else "-",
            common.fmt_bytes(r.get("peak_bytes")),
        ] + ([_x(r.get("speedup_vs_first_backend"))] if first else []))
    return common.format_table(
        ["T", "op", "pass", "C", "ms", "IQR ms", "n", "softmax/op", "rec/chunk", "GFLOP/s", "% matmul", "peak MiB"]
        + ([f"{first}/op"] if first else []), rows, align="rllrrrrrrrrr" + ("r" if first else ""))


def compute_targets(results, skipped, a, matmul: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The targets (see `_targets_for`), once per backend of --backends when several ran (names prefixed
    "[backend] "; softmax, which has no backend, is the reference of every one)."""
    chosen = list(getattr(a, "backends", None) or ["auto"])
    if chosen == ["auto"]:
        return _targets_for(results, skipped, a, matmul)
    out = []
    if getattr(a, "targets", "15") == "34" and "cpu" in chosen and "torch" in chosen:
        by = {(r["T"], r["op"], r["mode"], r["pass"], r.get("backend")): r for r in results if "ms" in r}
        for (T, op, mode, ps, b), r in sorted(by.items(), key=lambda kv: str(kv[0])):
            if T != SMALL_T or b != "cpu":
                continue
            base = by.get((T, op, mode, ps, "torch"))
            value = base["ms"] / r["ms"] if base is not None else None
            out.append({"target": f"[cpu vs torch] {_label({'op': op, 'mode': mode})} {PASS_LABEL[ps]} at T={T}: "
                                  "torch time / cpu time", "T": T, "measured": value, "threshold": 1.0, "unit": "x",
                        "met": (value >= 1.0) if value is not None else None,
                        "note": None if base is not None else "the torch row did not run", "backend": "cpu"})
    if getattr(a, "targets", "15") == "34":
        out += _hf_gdn_targets(results, skipped, a, chosen)
    for b in chosen:
        def mine(r, b=b):
            return r.get("backend") in (b, None)
        for t in _targets_for([r for r in results if mine(r)], [s for s in skipped if mine(s)], a, matmul):
            out.append({**t, "target": f"[{b}] {t['target']}", "backend": b})
    return out


def _hf_gdn_targets(results, skipped, a, chosen) -> List[Dict[str, Any]]:
    """The target Gated DeltaNet chunk forward >= 3x transformers' torch_chunk_gated_delta_rule at T = 2048, per
    backend that ran (only when the peer family is asked for; skipped rows give the reason)."""
    if "peer" not in a.families or "delta" not in a.families:
        return []
    T = HF_GDN_T
    by = {(r["op"], r.get("backend")): r for r in results
          if "ms" in r and r["T"] == T and r["mode"] == "chunk" and r["pass"] == "fwd"}
    peer = by.get((HF_GDN, None))
    why = None if peer is not None else next(
        (s["reason"] for s in skipped if s["op"] == HF_GDN and s["T"] == T), f"T={T} not in --T or the row failed")
    out = []
    for b in ([None] if chosen == ["auto"] else chosen):
        mine = by.get(("gated_deltanet", b))
        value = peer["ms"] / mine["ms"] if peer is not None and mine is not None else None
        note = why if peer is None else (None if mine is not None else "the Gated DeltaNet row did not run")
        out.append({"target": (f"[{b}] " if b else "") + f"Gated DeltaNet chunk fwd at T={T}: transformers' "
                              "torch_chunk_gated_delta_rule time / op time", "T": T, "measured": value,
                    "threshold": 3.0, "unit": "x", "met": (value >= 3.0) if value is not None else None,
                    "note": note, **({"backend": b} if b else {})})
    return out


def _targets_for(results, skipped, a, matmul: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The targets at T = 16384, from this run's measurements (never hard-coded), thresholds of --targets:
    "15": linear elu+1 chunk fwd >= 30x and fwd+bwd >= 25x softmax, fwd >= 40% of the matmul rate; delta chunk
    fwd >= 15x and fwd+bwd >= 10x softmax (and the first version's chunk-over-recurrent 20x); or "34", the
    compiled CPU kernels' (TARGET_SETS["34"])."""
    T = TARGET_T
    th = TARGET_SETS[getattr(a, "targets", "15")]
    by = {(r["T"], r["op"], r["mode"], r["pass"]): r for r in results if "ms" in r}
    skip = {(s["T"], s["op"], s["mode"], s["pass"]): s["reason"] for s in skipped}

    def why_missing(key) -> str:
        if key[0] not in a.T:
            return f"T={T} not in --T"
        if key in skip:
            return f"{_label({'op': key[1], 'mode': key[2]})} {PASS_LABEL[key[3]]} skipped: {skip[key]}"
        op = OP_BY_KEY[key[1]]
        if op.family not in a.families:
            return f"family {op.family} not in --families"
        if key[2] != "sdpa" and key[2] not in a.modes:
            return f"mode {key[2]} not in --modes"
        if key[3] not in a.passes:
            return f"pass {key[3]} not in --passes"
        return f"{_label({'op': key[1], 'mode': key[2]})} {PASS_LABEL[key[3]]} failed"

    def ratio(num_key, den_key):
        num, den = by.get(num_key), by.get(den_key)
        if num is None or den is None:
            return None, why_missing(num_key if num is None else den_key)
        return num["ms"] / den["ms"], None

    out = []

    def add(name, value, why, threshold, unit):
        out.append({"target": name, "T": T, "measured": value, "threshold": threshold, "unit": unit,
                    "met": (value >= threshold) if value is not None else None, "note": why})

    def lin(ps):
        return (T, "linear", "chunk", ps)

    def smk(ps):
        return (T, "softmax", "sdpa", ps)

    add("linear elu+1 chunk fwd: softmax time / op time", *ratio(smk("fwd"), lin("fwd")), th["linear"][0], "x")
    add("linear elu+1 chunk fwd+bwd: softmax time / op time", *ratio(smk("fwdbwd"), lin("fwdbwd")), th["linear"][1],
        "x")
    r = by.get(lin("fwd"))
    if r is not None and r.get("gflops") is None:
        add(f"linear elu+1 chunk fwd: achieved / measured {matmul['dtype']} matmul rate", None,
            f"chunk size used unknown ({r.get('chunk_size_error')})", th["linear"][2], "fraction")
    else:
        add(f"linear elu+1 chunk fwd: achieved / measured {matmul['dtype']} matmul rate",
            r["gflops"] / matmul["gflops"] if r else None, None if r else why_missing(lin("fwd")), th["linear"][2],
            "fraction")
    for op in (o for o in OPS if o.family == "delta"):
        def dk(mode, ps, op=op):
            return (T, op.key, mode, ps)

        add(f"{op.label} chunk fwd: softmax time / op time", *ratio(smk("fwd"), dk("chunk", "fwd")), th[op.key][0],
            "x")
        if th["rec"] is not None:
            add(f"{op.label} chunk fwd: recurrent time / chunk time",
                *ratio(dk("recurrent", "fwd"), dk("chunk", "fwd")), th["rec"], "x")
        add(f"{op.label} chunk fwd+bwd: softmax time / op time",
            *ratio(smk("fwdbwd"), dk("chunk", "fwdbwd")), th[op.key][1], "x")
    return out


def targets_text(targets) -> str:
    rows = []
    for t in targets:
        if t["unit"] == "fraction":
            meas = f"{100 * t['measured']:.1f} %" if t["measured"] is not None else "-"
            thr = f">= {100 * t['threshold']:.0f} %"
        else:
            meas = f"{t['measured']:.1f}x" if t["measured"] is not None else "-"
            thr = f">= {t['threshold']:g}x"
        status = "met" if t["met"] else ("MISSED" if t["met"] is False else "not measured")
        rows.append([t["target"], meas, thr, status + (f" ({t['note']})" if t["note"] else "")])
    return common.format_table(["target (T = %d)" % TARGET_T, "measured", "target", "status"], rows, align="lrrl")


def make_plot(path, results, a, info, matmul) -> None:
    ok = [r for r in results if "ms" in r]
    panels = []
    for ps in a.passes:
        series = []
        for op in OPS:
            for mode in (op.modes if op.family != "softmax" else ("sdpa",)):
                for b in _backends(a, op):  # one series per backend
                    rows = sorted((r for r in ok if r["op"] == op.key and r["mode"] == mode and r["pass"] == ps
                                   and r.get("backend") == b), key=lambda r: r["T"])
                    if rows:
                        series.append({"label": _label(rows[0]), "x": [r["T"] for r in rows],
                                       "y": [r["ms"] for r in rows], "color": op.color,
                                       "linestyle": "--" if mode == "recurrent" else ("-" if b in (None, a.backends[0])
                                                                                      else "-."),
                                       "marker": "s" if mode == "recurrent" else "o"})
        panels.append({"title": f"{PASS_LABEL[ps]} time", "xlabel": "T", "ylabel": "ms (median)", "series": series})
    series = []
    for op in OPS:
        if op.family == "softmax":
            continue
        for ps in a.passes:
            for b in _backends(a, op):
                rows = sorted((r for r in ok if r["op"] == op.key and r["mode"] == "chunk" and r["pass"] == ps
                               and r.get("backend") == b and r.get("speedup_vs_softmax")), key=lambda r: r["T"])
                if rows:
                    tag = f" [{b}]" if b else ""
                    series.append({"label": f"{op.label} chunk{tag} {PASS_LABEL[ps]}", "x": [r["T"] for r in rows],
                                   "y": [r["speedup_vs_softmax"] for r in rows], "color": op.color,
                                   "linestyle": "-" if ps == "fwd" else ":"})
    if series:
        panels.append({"title": "speed-up over softmax (same pass)", "xlabel": "T",
                       "ylabel": "softmax time / op time", "series": series, "hline": 1.0})
    title = (f"linattn bench ops  B={a.B} H={a.H} K={a.K} V={a.V} {a.dtype} {a.device}  |  {info['cpu']}, "
             f"{info['torch_threads']} threads, torch {info['torch']}  |  matmul {matmul['gflops']:.0f} GFLOP/s"
             f"  |  {info['date']}")
    common.plot_panels(path, panels, title=title)


def run(a) -> int:
    """Run the `linattn bench ops` benchmark (module docstring).

    Args:
        a: The options parsed with `add_arguments` (`linattn bench ops --help` lists them).

    Returns:
        The exit code (0: success).

    Raises:
        UsageError: Bad options.
    """
    _validate(a)
    if a.threads:
        torch.set_num_threads(a.threads)
    a.T = sorted(set(a.T))
    log = (lambda s: None) if a.quiet else (lambda s: (sys.stderr.write(s + "\n"), sys.stderr.flush()))
    t_start = time.perf_counter()

    cases, skipped, caps = _plan(a)
    paths = common.output_paths("ops", a.out, overwrite=a.overwrite, stem=a.name)

    info = common.machine_info(a.device)
    print("linattn bench ops")
    print(common.describe_machine(info))
    log(f"measuring the {a.dtype} matmul rate ({a.matmul_n}^3) ...")
    matmul = common.matmul_rate(a.matmul_n, DTYPES[a.dtype], a.device)
    print(f"matmul   {matmul['gflops']:.1f} GFLOP/s median at the start (best {matmul['gflops_best']:.1f}), "
          f"{a.dtype} {a.matmul_n}x{a.matmul_n}x{a.matmul_n} on {a.device}")
    print(f"shape    B={a.B} H={a.H} K={a.K} V={a.V} {a.dtype} on {a.device}; --chunk-size {a.chunk_size}; "
          f"causal; T = {' '.join(map(str, a.T))}")
    log(f"running {len(cases)} cases ({len(skipped)} skipped) ...")

    results = run_cases(a, cases, log)
    # the matmul rate again at the end: on a shared machine it moves; the higher one is the reference
    log("measuring the matmul rate again ...")
    matmul_end = common.matmul_rate(a.matmul_n, DTYPES[a.dtype], a.device)
    matmul["gflops_start"], matmul["gflops_end"] = matmul["gflops"], matmul_end["gflops"]
    matmul["gflops"] = max(matmul["gflops_start"], matmul["gflops_end"])
    print(f"matmul   {matmul_end['gflops']:.1f} GFLOP/s median at the end; reference rate "
          f"{matmul['gflops']:.1f} GFLOP/s (the higher of start and end)")
    used = chunk_sizes_used(results)
    print(chunk_line(a.chunk_size, used))
    print()
    derive(results, a, matmul["gflops"])
    targets = compute_targets(results, skipped, a, matmul)

    mem = common.memory_method(a.device) if not a.no_memory else "none"
    notes = [
        "ms: median over n timed calls after %d warm-up call(s); IQR: interquartile range of those calls; "
        "%s" % (a.warmup, "the cases of each T were timed interleaved in rounds, each case's calls spread "
                          "evenly over the rounds (inputs rebuilt, untimed, before each call), so background "
                          "load hits them alike"
                if a.interleave else "each case was timed in one block (--no-interleave)"),
        "fwd runs under torch.no_grad(); fwd+bwd is the forward with autograd plus backward of a random "
        "output gradient into all float inputs (q, k, v; beta, g for the delta rule)",
        "inputs: q, k, v ~ N(0, 1); elu+1 linear attention is causal and normalised; DeltaNet and Gated "
        "DeltaNet use L2-normalised q, k, beta = sigmoid(N(0,1)), Gated DeltaNet g = -softplus(N(0,1))/16; "
        "EFLA (exact=True) uses raw keys; delta-variants: Comba (p = k, g as Gated DeltaNet), DeltaProduct "
        "(n=%d keys per token, no gate; its C counts sub-steps), KDA (delta_rule with g = -softplus(N(0,1))/16 "
        "per key channel), all with L2-normalised q, k and beta = sigmoid(N(0,1)); RWKV-7 (rwkv7: r, k ~ N(0, 1), "
        "w = -exp(-1/2) sigmoid(N(0,1)), a = -kk, b = kk sigmoid(N(0,1)), kk L2-normalised; the delta core over "
        "2 sub-steps per token, its C counts sub-steps)" % DP_HOUSEHOLDER,
        "feedback (chunk form, block = C): FoX g = logsigmoid(N(2, 1)); DeltaFormer beta = sigmoid(N(0,1)), "
        "stage1_query k; PaTH w = L2-normalised N(0, 1), beta = 2 sigmoid(N(0,1)), no forget gate",
        "test-time (as the layers at initialisation): MesaNet L2-normalised q, k, beta = sigmoid(N(0,1)), "
        "g = logsigmoid(N(0,1)), lam = 1, solver cg with %d iterations and tol=0; TTT-Linear / TTT-MLP / Titans "
        "raw q, k (Titans: L2-normalised), learning rate sigmoid(N(0,1))/K (x0.1 for the MLPs), Titans alpha = "
        "sigmoid(N(0,1) - 4), eta = sigmoid(N(0,1)), inner weights N(0, 0.02), MLP hidden %dK, mini_batch %d "
        "(its C)" % (MESA_ITERS, TT_HIDDEN, TT_MINI_BATCH),
        "softmax/op: softmax_attention time / op time at the same T and pass; rec/chunk: the op's recurrent "
        "time / its chunk time",
        "C: the chunk size the chunk form really ran with (a backend may round or cap --chunk-size=%d; "
        "* marks such rows); it is the C of the flop counts" % a.chunk_size,
        "GFLOP/s from nominal flop counts: linear chunk 4*B*H*T*K*(C+V); linear "
        "recurrent 4*B*H*T*K*V; delta chunk B*H*T*(6CK+4CV+6KV), delta recurrent 6*B*H*T*K*V; softmax "
        "2*B*H*T^2*(K+V), counting the masked half (causal kernels do about half of that work); "
        "fwd+bwd counted as 3x fwd. % matmul = GFLOP/s / the reference matmul rate above (the higher of "
        "the two measurements, start and end)",
        "peak MiB: " + (common.MEMORY_METHODS[mem] if not a.no_memory else "not measured (--no-memory)"),
        "nothing is extrapolated: cases not run are listed under 'skipped'",
    ]
    if info.get("loadavg_1_5_15min"):
        notes.append("the cpus may be shared with other processes (load average at start %s, at end %s): "
                     "timings are noisy, see the IQR" % (info["loadavg_1_5_15min"], common.loadavg()))

    table = results_table(results)
    skipped_lines = _skipped_summary(skipped)
    text = "\n".join([
        "results", table, "",
        "skipped", *(skipped_lines or ["  none"]), "",
        "notes", *("  - " + n for n in notes), "",
        "targets", targets_text(targets),
    ])
    print(text)

    report = {
        "benchmark": "ops", "machine": info, "matmul": matmul,
        "config": {k: v for k, v in vars(a).items() if k != "run"}, "caps": caps,
        "target_T": TARGET_T, "results": results, "skipped": skipped, "targets": targets, "notes": notes,
        "memory_method": common.MEMORY_METHODS[mem] if not a.no_memory else None,
        "chunk_size": {"requested": a.chunk_size, "used": used},
        "wall_s": time.perf_counter() - t_start,
    }
    header = "\n".join(["linattn bench ops", common.describe_machine(info),
                        f"matmul   {matmul['gflops_start']:.1f} GFLOP/s at the start, {matmul['gflops_end']:.1f} "
                        f"at the end ({a.dtype}, {a.matmul_n}^3); reference {matmul['gflops']:.1f}",
                        f"shape    B={a.B} H={a.H} K={a.K} V={a.V} {a.dtype} {a.device}",
                        chunk_line(a.chunk_size, used), "", ""])
    atomic_write_text(paths["txt"], header + text + "\n")
    write_json(paths["json"], report)
    plot_note = save_figure(paths["png"], lambda p: make_plot(p, results, a, info, matmul))
    print()
    print(f"wrote {paths['txt']}, {paths['json']}, {plot_note}  [{time.perf_counter() - t_start:.0f} s]")
    return 0


def _skipped_summary(skipped) -> List[str]:
    """One line per (op, mode, pass, reason), listing the T values."""
    groups: Dict[Tuple, List[int]] = {}
    for s in skipped:
        groups.setdefault((s["op"], s["mode"], s["pass"], s["reason"]), []).append(s["T"])
    return [f"  {_label({'op': op, 'mode': mode})} {PASS_LABEL[ps]} at T = {', '.join(map(str, Ts))}: {why}"
            for (op, mode, ps, why), Ts in groups.items()]


__all__ = ["DESCRIPTION", "add_arguments", "run", "build_case", "case_chunk_size", "chunk_sizes_used", "flops",
           "compute_targets", "OPS", "TARGET_T"]
