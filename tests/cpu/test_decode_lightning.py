"""The compiled block's lightning kind (kind 8, csrc/decode_lightning.h) and its scaled residual order (`res_scaled`,
MiniMax's), against a float64 reference written from the formulas:

    xn = rmsnorm(x) n1w;  y = W xn = [per head q_h | k_h | v_h (K each) | gate (H K)];  q, k, v = silu(.)
    S_h = decay_h S0_h + k_h v_h^T;  o_h = S_h^T q_h;  o = rmsnorm(o over all heads) nw * sigmoid(gate)
    h = a1 xn + b1 Wo o;  hn = rmsnorm(h) n2w;  out = a2 hn + b2 Wd (silu(u) * g), [u | g] = Wgu hn

over several tokens (the state carried), batch 1-3, with and without an FFN, fp64 and fp32, and hostile rows (a NaN
row stays in its row; huge inputs saturate the gate without NaN)."""
import pytest
import torch

from linattn.cpu import decode as cpu_decode

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler: the compiled kernels are off")

EPS1, EPS2, NEPS = 1e-5, 1e-6, 1e-6


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _weights(H, K, d, hid, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return dict(n1w=1 + 0.2 * r(d), W=r(4 * H * K, d) / d ** 0.5, decay=torch.exp(-torch.rand(H, generator=g,
                dtype=torch.float64)), nw=1 + 0.2 * r(H * K), Wo=r(d, H * K) / (H * K) ** 0.5, n2w=1 + 0.2 * r(d),
                Wgu=r(2 * hid, d) / d ** 0.5, Wd=r(d, hid) / hid ** 0.5)


def _reference(w, x, S0, H, K, factors, ffn=True, planted=None):
    """One token through the block, in float64, from the formulas above; (out, S). `planted`: one part computed
    wrongly ("slope": the decay squared, "norm_per_head", "factors_swapped": alpha for beta, "gate_input": the gate
    from x, not the normed x)."""
    a1, b1, a2, b2 = (factors[1], factors[0], factors[3], factors[2]) if planted == "factors_swapped" else factors
    B = x.shape[0]
    xn = _rms(x, w["n1w"], EPS1)
    y = xn @ w["W"].T
    qkv = torch.nn.functional.silu(y[:, :3 * H * K]).view(B, H, 3, K)
    q, k, v = qkv.unbind(2)
    decay = w["decay"] ** 2 if planted == "slope" else w["decay"]
    S = decay.view(1, H, 1, 1) * S0 + k.unsqueeze(-1) * v.unsqueeze(-2)
    o = torch.einsum("bhk,bhkv->bhv", q, S)
    if planted == "norm_per_head":
        o = _rms(o, 1.0, NEPS).reshape(B, H * K) * w["nw"]
    else:
        o = _rms(o.reshape(B, H * K), w["nw"], NEPS)
    gate = x @ w["W"][3 * H * K:].T if planted == "gate_input" else y[:, 3 * H * K:]
    o = o * torch.sigmoid(gate)
    h = a1 * xn + b1 * (o @ w["Wo"].T)
    if not ffn:
        return h, S
    hn = _rms(h, w["n2w"], EPS2)
    ug = hn @ w["Wgu"].T
    hid = ug.shape[1] // 2
    f = (torch.nn.functional.silu(ug[:, :hid]) * ug[:, hid:]) @ w["Wd"].T
    return a2 * hn + b2 * f, S


def _plan(w, B, H, K, d, hid, factors, dtype, ffn=True):
    keep = {n: t.to(dtype).contiguous() for n, t in w.items()}
    p = cpu_decode.BlockPlan(B=B, H=H, HV=H, K=K, V=K, d=d, ny=4 * H * K, hid=hid if ffn else 0, kind=8,
                             nthreads=1, has_ffn=int(ffn), n1eps=EPS1, n2eps=EPS2, has_norm=1, norm_eps=NEPS,
                             res_scaled=1)
    for n in ("n1w", "W", "decay", "nw", "Wo") + (("n2w", "Wgu", "Wd") if ffn else ()):
        setattr(p, n, keep[n].data_ptr())
    p.res_a1, p.res_b1, p.res_a2, p.res_b2 = factors
    p.keep = keep
    return p


def _run(p, x, S0):
    B, d = x.shape
    S = torch.empty(B * p.H * p.K * p.V, dtype=x.dtype)
    out = torch.empty(B, d, dtype=x.dtype)
    cpu_decode.block_step(p, cpu_decode.block_function(x.dtype), x.contiguous(), None,
                          None if S0 is None else S0.contiguous(), None, S, out)
    return out, S.view(B, p.H, p.K, p.V)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("B,ffn", [(1, True), (3, True), (2, False)])
def test_tokens_match_the_formulas(B, ffn, dtype, tol):
    """Five tokens, the state carried from one to the next (the first from none: S0 = 0), factors off 1."""
    H, K, d, hid = 3, 8, 24, 20
    factors = (1.3, 0.7, 1.2, 0.8)
    w = _weights(H, K, d, hid)
    p = _plan(w, B, H, K, d, hid, factors, dtype, ffn)
    g = torch.Generator().manual_seed(1)
    S_ref, S = torch.zeros(B, H, K, K, dtype=torch.float64), None
    for _ in range(5):
        x = 2 * torch.randn(B, d, generator=g, dtype=torch.float64)
        want, S_ref = _reference(w, x, S_ref, H, K, factors, ffn)
        got, S = _run(p, x.to(dtype), S)
        assert (got.double() - want).abs().max() <= tol * want.abs().max()
        assert (S.double() - S_ref).abs().max() <= tol * S_ref.abs().max()


@pytest.mark.parametrize("planted", ["slope", "norm_per_head", "factors_swapped", "gate_input"])
def test_a_planted_error_is_seen(planted):
    """The comparison above tells the block's parts apart: a reference with another decay, the output norm per head
    instead of over all heads, alpha and beta swapped, or the gate from x instead of the normed x differs from the
    kernel by far more than the tolerance."""
    H, K, d, hid, B = 3, 8, 24, 20, 2
    factors = (1.3, 0.7, 1.2, 0.8)
    w = _weights(H, K, d, hid)
    p = _plan(w, B, H, K, d, hid, factors, torch.float64)
    x = 2 * torch.randn(B, d, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    S0 = torch.randn(B, H, K, K, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    got, _ = _run(p, x, S0)
    want, _ = _reference(w, x, S0, H, K, factors)
    assert (got - want).abs().max() <= 1e-12 * want.abs().max()
    bad, _ = _reference(w, x, S0, H, K, factors, planted=planted)
    assert (got - bad).abs().max() > 1e-3 * bad.abs().max()


def test_a_nan_row_stays_in_its_row_and_huge_inputs_stay_finite():
    """A NaN in one batch row's input: that row's output and state are NaN, the other row's are what it gets alone
    (the reference's). Inputs of 1e30: the norms bring them back (no inf or NaN)."""
    H, K, d, hid = 2, 8, 16, 12
    factors = (1.3, 0.7, 1.2, 0.8)
    w = _weights(H, K, d, hid)
    x = torch.randn(2, d, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    S0 = torch.zeros(2, H, K, K, dtype=torch.float64)
    x[0, 3] = float("nan")
    got, S = _run(_plan(w, 2, H, K, d, hid, factors, torch.float64), x, S0)
    want, _ = _reference(w, x[1:], S0[1:], H, K, factors)
    assert got[0].isnan().all() and S[0].isnan().any()
    assert (got[1] - want[0]).abs().max() <= 1e-12 * want.abs().max()
    got, S = _run(_plan(w, 2, H, K, d, hid, factors, torch.float64), 1e30 * x.nan_to_num(), S0)
    assert torch.isfinite(got).all()
