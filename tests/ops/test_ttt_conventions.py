"""Issue 33.10: how the TTT conventions of the paper's code and of flash-linear-attention relate to `linattn.ttt`
(ops/ttt.py's module docstring). Each convention is written here from its formula, token by token in fp64, with
the inner gradients by autograd; only TTT-Linear with residual=True (f(x) = x + LN(x W + b)).

    ours:   W_t = W_0 - sum_{s<=t} eta_s u_s                        o_t = scale q_t + LN(z_t)
    paper:  W_t = W_0 - (1/t) sum_{s<=t} eta_s u_s                  o_t = scale q_t + LN(z_t)
    fla:    W_t = W_0 - eta_t sum_{s<=t} u_s  (end: eta_last)       o_t = z_t + LN(z_t)

with u_s = grad_W 1/2 ||k_s + LN(k_s W_0 + b_0) - v_s||^2 at the mini-batch's start W_0, t, s counted from 1
inside the mini-batch, and z_t = scale q_t W_t + b_t.
"""
import torch

import linattn

B, T, H, D, MB = 1, 8, 2, 4, 4


_gen = torch.Generator().manual_seed(1)
# initial inner weights away from 0 (at W = 0, b = 0 every LN input is 0 and the gradients are all alike)
INIT = (0.5 * torch.randn(H, D, D, generator=_gen, dtype=torch.float64),
        0.5 * torch.randn(H, D, generator=_gen, dtype=torch.float64))


def _ln(z, eps=1e-6):
    zc = z - z.mean(-1, keepdim=True)
    return zc / torch.sqrt((zc * zc).mean(-1, keepdim=True) + eps)


def _grads(W, b, k, v):
    """u = (dW, db) of 1/2 ||k + LN(k W + b) - v||^2 for one token, per head: k, v [H, D], W [H, D, D], b [H, D]."""
    W, b = W.detach().requires_grad_(), b.detach().requires_grad_()
    with torch.enable_grad():
        loss = 0.5 * ((k + _ln(torch.einsum("hd,hde->he", k, W) + b) - v) ** 2).sum()
        return torch.autograd.grad(loss, (W, b))


def _run(q, k, v, eta, convention, with_z=False, mb=MB):
    """-> o [1, T, H, D] (and z_t, the inner model's outputs before the LayerNorm, if with_z)."""
    q, k, v, eta = (x[0].double() for x in (q, k, v, eta))   # [T, H, *]
    scale = D ** -0.5
    W0, b0 = INIT
    outs, zs = [], []
    for start in range(0, T, mb):
        us = [_grads(W0, b0, k[t], v[t]) for t in range(start, min(start + mb, T))]
        for i in range(len(us)):
            t = start + i
            rates = eta[start:t + 1]                                        # [i + 1, H]
            if convention == "ours":
                c = rates
            elif convention == "paper":
                c = rates / (i + 1)
            else:  # fla: the reading token's rate for every gradient it reads
                c = eta[t].expand_as(rates)
            W = W0 - sum(c[s, :, None, None] * us[s][0] for s in range(i + 1))
            b = b0 - sum(c[s, :, None] * us[s][1] for s in range(i + 1))
            x = scale * q[t]
            z = torch.einsum("hd,hde->he", x, W) + b
            outs.append((z if convention == "fla" else x) + _ln(z))
            zs.append(z)
        if convention == "fla":
            last = eta[start + len(us) - 1]
            W0 = W0 - sum(last[:, None, None] * u[0] for u in us)
            b0 = b0 - sum(last[:, None] * u[1] for u in us)
        else:
            W0, b0 = W, b   # ours and the paper end the mini-batch with the last reader's weights
    o = torch.stack(outs).unsqueeze(0)                                     # [1, T, H, D]
    return (o, torch.stack(zs).unsqueeze(0)) if with_z else o


def _inputs(per_mini_batch):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D, generator=gen, dtype=torch.float64) for _ in range(3))
    eta = 0.5 * torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    if per_mini_batch:   # one rate per mini-batch (per head)
        eta = eta[:, ::MB].repeat_interleave(MB, dim=1)
    return q, k, v, eta


def test_our_convention_is_the_formula():
    q, k, v, eta = _inputs(per_mini_batch=False)
    for mode in ("chunk", "recurrent"):
        o, _ = linattn.ttt(q, k, v, eta, mini_batch=MB, mode=mode, initial_state=INIT)
        torch.testing.assert_close(o, _run(q, k, v, eta, "ours"), rtol=1e-10, atol=1e-10)


def test_fla_convention_matches_ours_with_one_rate_per_mini_batch():
    # then W_t is the same, and fla's output is ours with scale q_t replaced by z_t (z_t - scale q_t added)
    q, k, v, eta = _inputs(per_mini_batch=True)
    (ours, z_ours), (fla, z_fla) = _run(q, k, v, eta, "ours", True), _run(q, k, v, eta, "fla", True)
    torch.testing.assert_close(z_fla, z_ours, rtol=1e-10, atol=1e-10)   # the same weights at every reader
    o, _ = linattn.ttt(q, k, v, eta, mini_batch=MB, initial_state=INIT)
    torch.testing.assert_close(o, ours, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(o - D ** -0.5 * q + z_fla, fla, rtol=1e-10, atol=1e-10)
    # with rates that vary inside a mini-batch the two conventions differ: neither expresses the other
    q, k, v, eta = _inputs(per_mini_batch=False)
    assert (_run(q, k, v, eta, "ours") - _run(q, k, v, eta, "fla")).abs().max() > 1e-3


def test_paper_averaging_is_not_a_choice_of_rates():
    # mini_batch = 1: t = 1 for every token, the averaging is a no-op and ours is the paper's
    q, k, v, eta = _inputs(per_mini_batch=False)
    o, _ = linattn.ttt(q, k, v, eta, mini_batch=1, initial_state=INIT)
    torch.testing.assert_close(o, _run(q, k, v, eta, "paper", mb=1), rtol=1e-10, atol=1e-10)
    # mini_batch = 4: reader 1 needs u_1 with eta_1, reader 2 with eta_1 / 2. Rates eta'_s = eta_s / s give the
    # paper's weights to the last reader of every gradient at most once, never to all readers
    paper = _run(q, k, v, eta, "paper")
    position = torch.arange(T, dtype=torch.float64).remainder(MB).add(1).view(1, T, 1)
    for folded in (eta, eta / position, eta / MB):
        o, _ = linattn.ttt(q, k, v, folded, mini_batch=MB, initial_state=INIT)
        assert (o - paper).abs().max() > 1e-3
