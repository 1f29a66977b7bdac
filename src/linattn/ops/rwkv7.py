"""`rwkv7`: RWKV-7's state update ("Goose", Peng et al. 2025), with flash-linear-attention's `chunk_rwkv7`
arguments, layout and meaning: on CPU tensors a compiled scan of its own (`cpu/rwkv7.py`), elsewhere (and with
backend="torch") a thin wrapper over the delta family's core (`delta_core.py`).

fla writes the recurrence with a state S `[V, K]` per head as S_t = S_{t-1} (Diag(exp(w_t)) + a_t b_t^T) +
v_t k_t^T. Its kernels (and this op) store the transpose, S `[K, V]` (states `[N, H, K, V]`), where it reads

    S_t = Diag(exp(w_t)) S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T,      o_t = scale * S_t^T r_t,

w the per-channel log decay (<= 0), a and b the two vectors of the rank-one term (the RWKV-7 layer passes
a = -kk, b = kk * sigmoid(.), with kk the normalised "removal key"), r the receptance (the query). Both the
decay and the rank-one term act on S_{t-1}; the write k v^T is not decayed. scale=None means 1.0, fla's
default for `chunk_rwkv7` (fla's naive `dplr_recurrence` scales by K**-0.5 instead; pass it explicitly).

The compiled scan (backend "auto" or "cpu" on CPU tensors; csrc/rwkv7.c) takes the transition as it is,
diagonal plus rank one, token by token with the state in cache, forward and backward, in every mode (it is exact
for all of them): 4 K V multiply-adds per token, every decay factor <= 1, so nothing overflows that the
recurrence itself does not. Half inputs compute in float32 there.

Why the PyTorch path runs on the core. The core's step is S' = D S - a k (S^T r)^T + a k v^T: its erase and
its write share one left vector (the write key k), while RWKV-7's erase uses b and its write k. So each token
becomes two sub-steps of the core, interleaved into a sequence of length 2T:

    sub-step 1 (erase):  g = w_t, key b_t, read key a_t, strength -1, value 0, query 0
                         -> S' = D S + b_t (a_t^T S)          (the core's read sees the undecayed S)
    sub-step 2 (write):  g = 0,   key k_t, read key 0,   strength +1, value v_t, query r_t
                         -> S'' = S' + k_t v_t^T,  o_t = scale S''^T r_t

Every form of the core (recurrent, chunk, parallel) is then exact for RWKV-7, states are the core's, and
packed offsets are doubled. The cost is the doubled length: a chunk of the per-channel-gate path (16
sub-steps) holds 8 tokens; this path is the fallback (GPU without fla, backend="torch", the kernels off).
The negative strength goes in after `prepare_delta` (whose beta check wants steps >= 0): the key-norm
rescaling a~ = a d^2 is linear in a, so negating a~ negates a.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, List, Optional, Tuple

import torch

from ..errors import LinattnTypeError
from ._common import (
    LOG_GATE_FLOOR,
    check_cu_seqlens,
    check_log_gate,
    check_mode,
    check_qkv,
    check_scale,
    compute_dtype,
)
from .backend import select_backend
from .delta_core import DeltaProblem, Rwkv7Source, check_state, check_tensor_like, prepare_delta, run_delta
from .registry import randn, register_op, uniform, unit


@dataclasses.dataclass
class Rwkv7Problem:
    """A checked `rwkv7` call: the caller's tensors, for the compiled scan, and on demand (`core()`) the
    interleaved problem of the delta core, for every other backend."""
    r: torch.Tensor
    w: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    scale: float
    mode: str
    chunk_size: int
    initial_state: Optional[torch.Tensor]
    output_final_state: bool
    offsets: Optional[List[int]]
    core_problem: Optional[DeltaProblem] = None

    cpu_kernel: ClassVar[str] = "rwkv7"  # the compiled CPU library (linattn/cpu/csrc/rwkv7.c) that runs it

    @property
    def q(self) -> torch.Tensor:
        """The query (r): the backend choice reads its device and dtype."""
        return self.r

    def core(self) -> DeltaProblem:
        """The delta core's problem of two sub-steps per token (module docstring), prepared once."""
        if self.core_problem is None:
            self.core_problem = _interleave(self)
        return self.core_problem

    def cpu_unsupported(self) -> Optional[str]:
        """Why the compiled scan does not take this call (None when it does): every mode (one exact scan), every
        float dtype (half inputs in float32), packed sequences and initial states."""
        if self.r.device.type != "cpu":
            return f"the compiled kernels take CPU tensors, got {self.r.device}"
        if self.r.numel() == 0 or self.v.numel() == 0:
            return "an empty dimension (nothing to scan)"
        return None

    def fla_unsupported(self) -> Optional[str]:
        return self.core().fla_unsupported()

    def triton_unsupported(self) -> Optional[str]:
        return self.core().triton_unsupported()

    def chunk_size_used(self, backend: str) -> int:
        """In core sub-steps (two per token) on the PyTorch path; the compiled scan goes token by token (1)."""
        return 1 if backend == "cpu" else self.core().chunk_size_used(backend)


def prepare_rwkv7(r, w, k, v, a, b, *, scale=None, mode: str = "chunk", chunk_size: int = 64,
                  initial_state=None, output_final_state: bool = False, cu_seqlens=None) -> Rwkv7Problem:
    """Check an `rwkv7` call (the arguments of `rwkv7`) -> its `Rwkv7Problem`."""
    B, T, H, K, V = check_qkv(r, k, v)
    for name, x in (("w", w), ("a", a), ("b", b)):
        check_tensor_like(x, name, r)
    check_log_gate(w, "w", B, T, H, K, allow_diagonal=True, ref=r)   # values: <= 0, no NaN
    scale = check_scale(scale, 1.0)
    check_mode(mode, chunk_size)   # in the caller's tokens (the core sees 2 * chunk_size sub-steps)
    if not isinstance(output_final_state, bool):
        raise LinattnTypeError(f"output_final_state must be a bool, got {type(output_final_state).__name__}")
    offsets = check_cu_seqlens(cu_seqlens, B, T)
    if initial_state is not None:
        check_state(initial_state, B if offsets is None else len(offsets) - 1, H, K, V, r.device, ref="r")
    return Rwkv7Problem(r, w, k, v, a, b, scale, mode, chunk_size, initial_state, output_final_state, offsets)


def _interleave(p: Rwkv7Problem) -> DeltaProblem:
    """The interleaved core problem (module docstring)."""
    r, w, k, v, a, b = p.r, p.w, p.k, p.v, p.a, p.b
    B, T = r.shape[:2]

    def interleave(first, second):  # two [B, T, H, *] -> [B, 2T, H, *], token t's sub-steps at 2t, 2t + 1
        return torch.stack([first, second], dim=2).reshape(B, 2 * T, *first.shape[2:])

    zk = torch.zeros_like(r)
    q_i = interleave(zk, r)
    k_i = interleave(b, k)
    v_i = interleave(torch.zeros_like(v), v)
    r_i = interleave(a, zk)
    g_i = interleave(w, torch.zeros_like(w))
    ones = r.new_ones(B, 2 * T, r.shape[2])
    cu_i = None if p.offsets is None else torch.tensor([2 * o for o in p.offsets], dtype=torch.int64)
    prob = prepare_delta(q_i, k_i, v_i, ones, g=g_i, r=r_i, channel_gate=True, scale=p.scale, mode=p.mode,
                         chunk_size=2 * p.chunk_size, initial_state=p.initial_state,
                         output_final_state=p.output_final_state, cu_seqlens=cu_i)
    sign = torch.tensor([-1.0, 1.0], dtype=prob.a.dtype, device=prob.a.device).repeat(T)[None, :, None]
    # fla's chunk_rwkv7 takes the call as it is (backend="fla"): the caller's tensors, w in the compute dtype
    source = Rwkv7Source(r, w.to(prob.q.dtype).clamp_min(-LOG_GATE_FLOOR), k, v, a, b, p.scale)
    return dataclasses.replace(prob, a=prob.a * sign, source=source)


def _run_cpu(p: Rwkv7Problem) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The compiled scan: flat [B*T, H, D] rows in the compute dtype, the sequences' boundaries."""
    from ..cpu.rwkv7 import rwkv7_scan  # on use: the kernels' module registers custom ops

    B, T, H = p.r.shape[:3]
    V = p.v.shape[-1]
    cdt = compute_dtype(p.r.dtype)
    flat = [x.reshape(B * T, *x.shape[2:]).to(cdt) for x in (p.r, p.w, p.k, p.v, p.a, p.b)]
    starts = p.offsets if p.offsets is not None else [i * T for i in range(B + 1)]
    S0 = p.initial_state.to(cdt) if p.initial_state is not None else None
    o, S = rwkv7_scan(*flat, S0, starts, p.scale)
    return o.view(B, T, H, V).to(p.r.dtype), (S if p.output_final_state else None)


def rwkv7(
    r: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    mode: str = "chunk",
    chunk_size: int = 64,
    backend: str = "auto",
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """RWKV-7's state update, with flash-linear-attention's `chunk_rwkv7` arguments, layout and meaning.

    S_t = Diag(exp(w_t)) S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T and o_t = scale * S_t^T r_t, with the state
    `[K, V]` per head (fla's layout; fla writes the transposed S_t = S_{t-1}(Diag(exp(w_t)) + a_t b_t^T) + v_t k_t^T).

    Args:
        r: The receptance (the query) `[B, T, H, K]`, any float dtype.
        w: The log decay `[B, T, H, K]` (<= 0).
        k: Keys `[B, T, H, K]`.
        v: Values `[B, T, H, V]`.
        a: The rank-one term's read vector `[B, T, H, K]` (the RWKV-7 layer passes -kk).
        b: The rank-one term's write vector `[B, T, H, K]` (the layer passes kk * sigmoid(.)).
        scale: The output scale; None means 1.0 (fla's default).
        initial_state: The state to start from, `[N, H, K, V]`, or None (zeros).
        output_final_state: Also return the state after the last token.
        cu_seqlens: int64 `[N+1]` offsets of N packed sequences (B == 1), each with its own state.
        mode: "chunk" (training), "recurrent" (decoding), "parallel" (quadratic closed form); the compiled CPU
            scan is exact for all three and runs the same scan for each.
        chunk_size: Counts tokens (the PyTorch path's per-channel-gate chunk caps it at 8 tokens: module
            docstring; the compiled scan does not use it).
        backend: "auto" (CPU tensors: the compiled scan when it builds, else PyTorch; CUDA: fla, else PyTorch),
            "cpu" (the compiled scan, csrc/rwkv7.c), "torch", "fla" (fla's chunk_rwkv7 / fused_recurrent_rwkv7, on
            CUDA; see docs/backends.md) or "triton" (the core's Triton kernels do not cover a read key of its own:
            "triton" warns once and falls back to PyTorch).

    Returns:
        o: The output `[B, T, H, V]`, in the input dtype.
        final_state: With output_final_state, the state `[N, H, K, V]` (N = B, or the number of sequences in
            cu_seqlens), fp32 (fp64 for fp64 inputs), which round-trips between modes and calls; otherwise None.

    Raises:
        LinattnError: An argument of the wrong shape, dtype or value (the message names it).

    Examples:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from linattn import rwkv7
        >>> B, T, H, K = 1, 10, 2, 8
        >>> r, k, v = torch.randn(3, B, T, H, K).unbind(0)
        >>> w = -torch.rand(B, T, H, K)
        >>> kk = F.normalize(torch.randn(B, T, H, K), dim=-1)
        >>> a, b = -kk, kk * torch.rand(B, T, H, K)
        >>> o, S = rwkv7(r, w, k, v, a, b, output_final_state=True)
        >>> o.shape, S.shape
        (torch.Size([1, 10, 2, 8]), torch.Size([1, 2, 8, 8]))
        >>> o_rec, _ = rwkv7(r, w, k, v, a, b, mode="recurrent")
        >>> torch.allclose(o, o_rec, atol=1e-5)
        True
    """
    prob = prepare_rwkv7(r, w, k, v, a, b, scale=scale, mode=mode, chunk_size=chunk_size,
                         initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    chosen = select_backend(backend, prob)
    if chosen == "cpu":
        return _run_cpu(prob)
    o, S = run_delta(prob.core(), chosen)
    B, T2, H, V = o.shape
    if T2 == r.shape[1]:   # fla's chunk_rwkv7 ran the tokens themselves
        return o, S
    return o.reshape(B, T2 // 2, 2, H, V)[:, :, 1], S


def _prepare(*args, backend: str = "auto", **kwargs):
    return prepare_rwkv7(*args, **kwargs)


def _example(gen, B, T, H, K, V, dtype):
    """As the RWKV-7 layer makes them: log-decay w in (-exp(-1/2), 0), a = -kk, b = kk * (0, 1), kk unit (the
    registry's conformance tests)."""
    kk = unit(gen, (B, T, H, K), dtype)
    w = uniform(gen, (B, T, H, K), dtype, -0.6065306597126334, 0.0)
    args = (randn(gen, (B, T, H, K), dtype), w, randn(gen, (B, T, H, K), dtype), randn(gen, (B, T, H, V), dtype),
            -kk, kk * uniform(gen, (B, T, H, 1), dtype))
    return args, {"scale": 0.5}


register_op("rwkv7", rwkv7, prepare=_prepare, backends=True, forms=("parallel", "chunk", "recurrent"),
            example=_example, reference="rwkv7_ref", state=True,
            description="RWKV-7's state update S <- Diag(exp(w)) S + b (a^T S) + k v^T (compiled CPU scan; 2 core "
                        "sub-steps per token on the PyTorch path)")
