"""The chunk forms of causal linear attention with linear-space features and no gate or a scalar gate.

`chunk_matmul_form`: the autograd form, only matmuls, with a scalar gate (and under torch.compile).
`linear_chunk`: the fast form with no gate, below. Both return a `FormResult` (`linear_common.py`).

The fast form is one `torch.autograd.Function` with a hand-written backward, for the hot path of `linear_attention`
(elu+1, relu, identity or any other linear-space map, with no decay):
num_i = phi(q_i) . (S_0 + sum_{j<=i} psi(k_j) v_j^T), den_i = phi(q_i) . (z_0 + sum_{j<=i} psi(k_j)).

Forward, per chunk c of C tokens (Q = phi(q), K = psi(k), V of the chunk; P_c [K_phi, V] and zP_c [K_phi]
the states before the chunk):

    A = tril(Q K^T),   num = A V + Q P_c,   den = A 1 + Q zP_c,
    P_{c+1} = P_c + K^T V,   zP_{c+1} = zP_c + K^T 1.

What makes it faster on a CPU than the autograd form (`chunk_matmul_form` below, still used with a gate and
under torch.compile):

* one layout pass per input, [B, T, H, D] -> [B, H, T', D] (T' = T padded to the chunk), straight into
  the buffers the batched matmuls read; the maps with an in-kernel form (`FeatureMap.fused_kernel`:
  elu+1, relu, identity) are applied in place in that buffer, and their backward needs only the
  features (d(elu+1)/dx = min(phi, 1), d relu/dx = [phi > 0]): no second exp in the backward;
* the matmuls stay V = 64 wide: the denominator comes from A's row sums and a matrix-vector product with
  the key-sum state, not from a column of ones appended to V (with MKL on the CPU this was written for,
  65-wide batched matmuls ran 40-80 % slower than 64-wide ones), and nothing is concatenated;
* the chunk-start states by a blocked running sum into one buffer (`_scan`), no stack;
* masks and accumulations in place (tril_, baddbmm_ on fresh buffers);
* a backward that reuses the forward's A and states: 8 batched matmuls, 2 matrix-vector products and
  two reverse running sums.

Causality is kept as everywhere else in linattn: A is masked by selection, the intra-chunk product
keeps `causal_matmul`'s guarantee (a later inf or NaN value never reaches an earlier row), and every
chunk state is a sum over earlier chunks only, in an order that does not depend on how many chunks
follow, so running on a prefix gives the bits of the full run's first outputs.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._common import causal_matmul, pad_time, reads_values
from .linear_common import FormResult

SCAN_BLOCK = 16  # chunks per block of the running sum (fixed: the order of additions never depends on T)
FUSED = (None, "identity", "relu", "elu+1")  # feature maps applied inside the buffers (None: given features)


def chunk_matmul_form(fq, fk, v, g, S, C: int) -> FormResult:
    """Causal chunk form for plain features with no gate or a scalar gate: only matmuls.

    fq, fk [B, H, T, Kf] and v [B, H, T, V] (no ones column: on this hot path the normaliser is
    computed beside the values, which keeps the matmuls 64 wide). Per chunk:
    o = (phi(Q) psi(K)^T * D) V + (phi(Q) * decay) S_prev, with D_ij = exp(G_i - G_j) from the
    gate's cumulative sum local to the chunk, so every exponent is <= 0. Backward keeps one
    state per chunk, never one per token.
    """
    B, H, T, Kf = fq.shape
    V = v.shape[-1]
    # one explicit copy into [B, H, n, C, D]: otherwise every bmm gathers its strided operands itself
    fq, fk, v = (pad_time(x, C, dim=2).contiguous() for x in (fq, fk, v))  # zero keys/values add nothing
    n = fq.shape[2] // C
    fq, fk, v = fq.view(B, H, n, C, Kf), fk.view(B, H, n, C, Kf), v.view(B, H, n, C, V)
    mask = torch.ones(C, C, dtype=torch.bool, device=v.device).tril()
    A = fq @ fk.transpose(-1, -2)  # [B, H, n, C, C]
    if g is None:
        A = A.masked_fill_(~mask, 0.0)  # in place: bmm's backward needs its inputs, not A
        U = torch.cat([fk.transpose(-1, -2) @ v, fk.sum(3).unsqueeze(-1)], dim=-1)  # each chunk's [kv | z]
        decay = None
        q_inter = fq
    else:
        # the running sum and its differences in fp64: with strong decays (Mamba2's dt A) |G| reaches ~1e3 inside
        # a chunk, and the difference of two fp32 sums would lose |G| * 6e-8 of every exponent
        G64 = pad_time(g[..., 0], C, dim=2).view(B, H, n, C).to(torch.float64).cumsum(-1)
        G = G64.to(A.dtype)
        A = A * torch.exp((G64.unsqueeze(-1) - G64.unsqueeze(-2)).to(A.dtype).masked_fill(~mask, float("-inf")))
        A = A.masked_fill_(~mask, 0.0)  # by selection: an inf key would make the masked 0 * inf NaN
        G_end = G[..., -1:]  # [B, H, n, 1]
        k_dec = fk * torch.exp((G64[..., -1:] - G64).to(A.dtype)).unsqueeze(-1)  # keys decayed to the chunk's end
        U = torch.cat([k_dec.transpose(-1, -2) @ v, k_dec.sum(3).unsqueeze(-1)], dim=-1)
        decay = torch.exp(G_end).unsqueeze(-1)  # [B, H, n, 1, 1]
        q_inter = fq * torch.exp(G).unsqueeze(-1)
    # the state before each chunk; a Python loop (+ stack) is several times faster than cumsum
    # along this axis on CPU, and keeps exactly one state per chunk for backward
    # (unbind, not U[:, :, i]: indexing would give each step a backward that writes a full-size gradient)
    starts = []
    decays = decay.unbind(2) if decay is not None else None
    for i, U_i in enumerate(U.unbind(2)):
        starts.append(S)
        S = (S if decays is None else decays[i] * S) + U_i
    starts = torch.stack(starts, dim=2)
    kv_prev, z_prev = starts[..., :V], starts[..., V]
    num = causal_matmul(A.flatten(0, 2), v.flatten(0, 2), input=(q_inter @ kv_prev).flatten(0, 2))
    den = A.sum(-1) + (q_inter * z_prev.unsqueeze(3)).sum(-1)
    return FormResult(num.view(B, H, n * C, V)[:, :, :T], den.view(B, H, n * C)[:, :, :T], None, S, None)



def _to_chunks(x: torch.Tensor, Tp: int) -> torch.Tensor:
    """[B, T, H, D] -> a new contiguous [B, H, Tp, D] buffer, zero-padded to Tp (one transposing copy)."""
    B, T, H, D = x.shape
    out = torch.empty(B, H, Tp, D, dtype=x.dtype, device=x.device)
    out[:, :, :T].copy_(x.transpose(1, 2))
    if Tp > T:
        out[:, :, T:].zero_()
    return out


def _features_(x: torch.Tensor, fused: Optional[str], T: int) -> torch.Tensor:
    """Apply the fused feature map in place to the buffer x [B, H, Tp, D]; padding rows get zero features."""
    if fused == "elu+1":
        torch.nn.functional.elu_(x).add_(1.0)
    elif fused == "relu":
        x.relu_()
    if fused in ("elu+1",) and x.shape[2] > T:
        x[:, :, T:].zero_()  # elu(0) + 1 = 1: padding keys must weigh 0
    return x


def _features_grad_(g: torch.Tensor, phi: torch.Tensor, fused: Optional[str]) -> torch.Tensor:
    """d phi / dx from the features alone, times g, in place on g."""
    if fused == "elu+1":  # phi = x + 1 for x > 0 (slope 1), exp(x) <= 1 otherwise (slope exp(x) = phi)
        return g.mul_(phi.clamp(max=1.0))
    if fused == "relu":
        return g.mul_(phi > 0)
    return g


def _scan(U: torch.Tensor, S0: Optional[torch.Tensor], reverse: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Exclusive running sums of U [B, H, n, K, W] along the chunks: (P, total) with
    P_c = S0 + sum_{c' < c} U_c' and total = S0 + sum_c U_c (reverse=True: sums over c' > c).

    In blocks of SCAN_BLOCK chunks: sums inside each block (all blocks at once), then over the blocks, then
    one broadcast add: 2 * SCAN_BLOCK + n / SCAN_BLOCK small steps instead of n. Forward, every P_c is
    formed by the same additions whatever the number of chunks that follow (bitwise prefix causality)."""
    B, H, n, K, W = U.shape
    s = SCAN_BLOCK
    m = -(-n // s)
    if m * s != n:
        U = torch.cat([U, U.new_zeros(B, H, m * s - n, K, W)], dim=2)
    Ub = U.view(B, H, m, s, K, W)
    P = torch.empty_like(Ub)
    inner = range(1, s) if not reverse else range(s - 2, -1, -1)
    first, last, step = (0, s - 1, -1) if not reverse else (s - 1, 0, 1)
    P[:, :, :, first].zero_()
    for j in inner:  # inside every block at once
        torch.add(P[:, :, :, j + step], Ub[:, :, :, j + step], out=P[:, :, :, j])
    block = P[:, :, :, last] + Ub[:, :, :, last]  # [B, H, m, K, W]
    starts = torch.empty_like(block)
    b0, b1, bstep = (0, m - 1, -1) if not reverse else (m - 1, 0, 1)
    if S0 is None:
        starts[:, :, b0].zero_()
    else:
        starts[:, :, b0].copy_(S0)
    for i in (range(1, m) if not reverse else range(m - 2, -1, -1)):  # over the blocks
        torch.add(starts[:, :, i + bstep], block[:, :, i + bstep], out=starts[:, :, i])
    total = starts[:, :, b1] + block[:, :, b1]
    P.add_(starts.unsqueeze(3))
    return P.view(B, H, m * s, K, W)[:, :, :n], total


def _causal_baddbmm_(out: torch.Tensor, A: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """out += A @ X for a causally masked A [N, C, C], in place, with `causal_matmul`'s guarantee: when X
    may hold inf or NaN (anything but a CPU tensor in eager mode that one reduction shows finite), the
    branch-free `causal_matmul` runs instead."""
    if reads_values(X) and bool(torch.isfinite(X.sum())):
        return out.baddbmm_(A, X)
    return out.copy_(causal_matmul(A, X, input=out))


class LinearChunk(torch.autograd.Function):
    """(q, k [B, T, H, Kf] (features, or the inputs of the `fused` map), v [B, T, H, V], S0 [B, H, Kf, V + 1],
    C, fused) -> (num [B, H, T, V], den [B, H, T], S_final [B, H, Kf, V + 1])."""

    @staticmethod
    def forward(ctx, q, k, v, S0, C: int, fused: Optional[str]):
        ctx.set_materialize_grads(False)
        B, T, H, Kf = q.shape
        V = v.shape[-1]
        n = -(-T // C)
        Tp = n * C
        Qb = _features_(_to_chunks(q, Tp), fused, T)
        Kb = _features_(_to_chunks(k, Tp), fused, T)
        Vb = _to_chunks(v, Tp)
        BHn = B * H * n  # explicit sizes: view(-1, ...) cannot infer them when a dimension is 0
        Q, K, Vc = Qb.view(BHn, C, Kf), Kb.view(BHn, C, Kf), Vb.view(BHn, C, V)
        A = torch.bmm(Q, K.transpose(1, 2)).tril_()                     # [BHn, C, C], masked by selection
        U = torch.bmm(K.transpose(1, 2), Vc).view(B, H, n, Kf, V)       # each chunk's kv
        P, S_kv = _scan(U, S0[..., :V])
        P = P.contiguous()
        zP, S_z = _scan(K.sum(1).view(B, H, n, Kf, 1), S0[..., V:])      # the normaliser's state, beside
        zP = zP.contiguous()
        num = _causal_baddbmm_(torch.bmm(Q, P.view(BHn, Kf, V)), A, Vc)
        den = torch.bmm(Q, zP.view(BHn, Kf, 1)).view(BHn, C).add_(A.sum(-1))
        ctx.save_for_backward(Q, K, Vc, A, P, zP)
        ctx.shape = (B, T, H, Kf, V, n, C, fused)
        num = num.view(B, H, Tp, V)[:, :, :T]
        den = den.view(B, H, Tp)[:, :, :T]
        return num, den, torch.cat([S_kv, S_z], dim=-1)

    @staticmethod
    def backward(ctx, dnum, dden, dS):
        Q, K, Vc, A, P, zP = ctx.saved_tensors
        B, T, H, Kf, V, n, C, fused = ctx.shape
        BHn = Q.shape[0]
        dN = Vc.new_zeros(B, H, n * C, V) if (dnum is None or n * C > T) else Vc.new_empty(B, H, n * C, V)
        dD = Vc.new_zeros(B, H, n * C)
        if dnum is not None:
            dN[:, :, :T].copy_(dnum)
        if dden is not None:
            dD[:, :, :T].copy_(dden)
        dN, dD = dN.view(BHn, C, V), dD.view(BHn, C, 1)
        # the chunk states' gradients: dU_c = dS + sum_{c' > c} Q_c'^T dnum_c' (reverse running sums)
        dU, dP0 = _scan(torch.bmm(Q.transpose(1, 2), dN).view(B, H, n, Kf, V),
                        dS[..., :V] if dS is not None else None, reverse=True)
        dz, dz0 = _scan(torch.bmm(Q.transpose(1, 2), dD).view(B, H, n, Kf, 1),
                        dS[..., V:] if dS is not None else None, reverse=True)
        dU = dU.contiguous().view(BHn, Kf, V)
        dA = torch.bmm(dN, Vc.transpose(1, 2)).add_(dD).tril_()         # [BHn, C, C]
        dQ = torch.bmm(dN, P.view(BHn, Kf, V).transpose(1, 2)).baddbmm_(dA, K)
        dQ.baddbmm_(dD, zP.view(BHn, 1, Kf))
        dK = torch.bmm(Vc, dU.transpose(1, 2)).baddbmm_(dA.transpose(1, 2), Q)
        dK.add_(dz.reshape(BHn, 1, Kf))
        dV = torch.bmm(K, dU).baddbmm_(A.transpose(1, 2), dN)
        dQ, dK = _features_grad_(dQ, Q, fused), _features_grad_(dK, K, fused)

        def back(x):  # [BHn, C, D] -> [B, T, H, D] (a view)
            return x.view(B, H, n * C, -1)[:, :, :T].transpose(1, 2)

        return back(dQ), back(dK), back(dV), torch.cat([dP0, dz0], dim=-1), None, None


def linear_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, S0: torch.Tensor, C: int,
                 fused: Optional[str] = None) -> FormResult:
    """The causal chunk form without a gate. q, k [B, T, H, Kf]: the features (fused=None) or the inputs of
    the fused map (`FUSED`); v [B, T, H, V]; any strides; S0 [B, H, Kf, V + 1].
    -> FormResult(num [B, H, T, V], den [B, H, T], None, final state [B, H, Kf, V + 1], None)."""
    num, den, S = LinearChunk.apply(q, k, v, S0, C, fused)
    return FormResult(num, den, None, S, None)
