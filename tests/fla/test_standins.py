"""The CPU stand-ins of tests/fla/standins.py against fla's own naive references (fla/ops/<op>/naive.py, which
compute in fp32), where both exist: the stand-ins are what the backend's tests trust, so they are checked first.
The references take no cu_seqlens and no in-kernel L2 norm: packed sequences are checked against separate calls
and the in-kernel norm against fla's formula applied before the reference."""
from __future__ import annotations

import pytest
import torch

from tests.fla import standins as S

pytest.importorskip("fla")
pytestmark = pytest.mark.usefixtures("one_thread_module")

B, T, H, K, V = 2, 9, 2, 4, 3


def _inputs(HV=H, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    beta = torch.rand(B, T, HV, generator=gen)
    g = -torch.rand(B, T, HV, generator=gen)
    gk = -0.5 * torch.rand(B, T, HV, K, generator=gen)
    h0 = torch.randn(B, HV, K, V, generator=gen)
    return q, k, v, beta, g, gk, h0


def _close(a, b, tol=2e-5):
    assert (a.double() - b.double()).abs().max().item() <= tol * max(1.0, b.abs().max().item())


def test_simple_gla_against_naive():
    from fla.ops.simple_gla.naive import naive_recurrent_simple_gla

    q, k, v, _, g, _, h0 = _inputs()
    o, s = S.chunk_simple_gla(q, k, v, g=g, scale=0.3, initial_state=h0, output_final_state=True)
    ro, rs = naive_recurrent_simple_gla(q, k, v, g, scale=0.3, initial_state=h0, output_final_state=True)
    _close(o, ro)
    _close(s, rs)
    # g_gamma is a g constant over batch and time
    gam = -torch.rand(H)
    o, _ = S.fused_recurrent_simple_gla(q, k, v, g_gamma=gam)
    ro, _ = naive_recurrent_simple_gla(q, k, v, gam.expand(B, T, H))
    _close(o, ro)


def test_gla_against_naive_with_fla_default_scale():
    from fla.ops.gla.naive import naive_recurrent_gla

    q, k, v, _, _, gk, h0 = _inputs()
    o, s = S.chunk_gla(q, k, v, gk, initial_state=h0, output_final_state=True)   # scale None: K**-0.5
    ro, rs = naive_recurrent_gla(q, k, v, gk, initial_state=h0, output_final_state=True)
    _close(o, ro)
    _close(s, rs)


def test_delta_rule_against_naive():
    from fla.ops.delta_rule.naive import delta_rule_recurrence

    q, k, v, beta, _, _, h0 = _inputs()
    o, s = S.chunk_delta_rule(q.double(), k.double(), v.double(), beta.double(), initial_state=h0,
                              output_final_state=True)
    ro, rs = delta_rule_recurrence(*(x.transpose(1, 2) for x in (q, k, v, beta)), initial_state=h0,
                                   output_final_state=True)
    _close(o, ro.transpose(1, 2))
    _close(s, rs)
    with pytest.raises(AssertionError, match="float32"):   # fla's own restriction, kept
        S.chunk_delta_rule(q, k, v, beta)


@pytest.mark.parametrize("HV", [H, 2 * H])
def test_gated_delta_rule_against_naive(HV):
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

    q, k, v, beta, g, _, h0 = _inputs(HV)
    o, s = S.chunk_gated_delta_rule(q, k, v, g, beta, scale=0.4, initial_state=h0, output_final_state=True)
    n = HV // H
    ro, rs = naive_recurrent_gated_delta_rule(q.repeat_interleave(n, 2), k.repeat_interleave(n, 2), v, beta, g,
                                              scale=0.4, initial_state=h0, output_final_state=True)
    _close(o, ro)
    _close(s, rs)
    o2, _ = S.fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, scale=0.4, initial_state=h0)
    _close(o2, ro)


@pytest.mark.parametrize("HV", [H, 2 * H])
def test_kda_against_naive(HV):
    from fla.ops.kda.naive import naive_recurrent_kda

    q, k, v, beta, _, gk, h0 = _inputs(HV)
    o, s = S.chunk_kda(q, k, v, gk, beta, initial_state=h0, output_final_state=True)
    ro, rs = naive_recurrent_kda(q, k, v, gk, beta, initial_state=h0, output_final_state=True)
    _close(o, ro)
    _close(s, rs)
    o2, _ = S.fused_recurrent_kda(q, k, v, gk, beta, initial_state=h0)
    _close(o2, ro)


def test_in_kernel_l2norm_is_fla_formula():
    from fla.ops.kda.naive import naive_recurrent_kda

    q, k, v, beta, _, gk, _ = _inputs()
    k = 3 * k + 0.1
    o, _ = S.chunk_kda(q, k, v, gk, beta, use_qk_l2norm_in_kernel=True)
    ro, _ = naive_recurrent_kda(S._l2(q), S._l2(k), v, gk, beta)
    _close(o, ro)
    assert (o - S.chunk_kda(q, k, v, gk, beta)[0]).abs().max() > 1e-2    # the flag is honoured


def test_cu_seqlens_is_separate_sequences():
    q, k, v, beta, g, _, h0 = _inputs()
    cat = [torch.cat([x[0, :4], x[1, 4:]])[None] for x in (q, k, v, beta, g)]
    cu = torch.tensor([0, 4, 9])
    rows = torch.stack([h0[0], h0[1]])
    o, s = S.chunk_gated_delta_rule(*cat[:3], cat[4], cat[3], initial_state=rows, output_final_state=True,
                                    cu_seqlens=cu)
    o1, s1 = S.chunk_gated_delta_rule(*(x[:1, :4] for x in (q, k, v, g, beta)), initial_state=h0[:1],
                                      output_final_state=True)
    o2, s2 = S.chunk_gated_delta_rule(*(x[1:, 4:] for x in (q, k, v, g, beta)), initial_state=h0[1:],
                                      output_final_state=True)
    _close(o, torch.cat([o1, o2], dim=1), 1e-6)
    _close(s, torch.cat([s1, s2]), 1e-6)


def test_rwkv7_against_dplr_naive():
    from fla.ops.generalized_delta_rule.dplr.naive import dplr_recurrence

    gen = torch.Generator().manual_seed(6)
    r, w, k, a, b = (torch.randn(B, T, H, K, generator=gen) for _ in range(5))
    w = -torch.rand(B, T, H, K, generator=gen)
    v, h0 = torch.randn(B, T, H, V, generator=gen), torch.randn(B, H, K, V, generator=gen)
    o, s = S.chunk_rwkv7(r, w, k, v, 0.3 * a, 0.3 * b, scale=K ** -0.5, initial_state=h0, output_final_state=True)
    ro, rs = dplr_recurrence(*(x.transpose(1, 2) for x in (r, k, v, 0.3 * a, 0.3 * b, w)), initial_state=h0)
    _close(o, ro.transpose(1, 2))
    _close(s, rs)


@pytest.mark.parametrize("window", [None, 3])
def test_forgetting_attention_against_naive(window):
    from fla.ops.forgetting_attn.naive import naive_forgetting_attn

    q, k, v, _, g, _, _ = _inputs()
    v = v[..., :3]
    o = S.parallel_forgetting_attn(q, k, v, g, scale=0.4, window_size=window)
    _close(o, naive_forgetting_attn(q, k, v, g, scale=0.4, window_size=window))


def test_path_attention_against_naive():
    from fla.ops.path_attn.naive import naive_path_attn

    gen = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(B, T, H, 16, generator=gen) for _ in range(3))
    w = torch.nn.functional.normalize(torch.randn(B, T, H, 16, generator=gen), dim=-1)
    beta, g = 2 * torch.rand(B, T, H, generator=gen), -torch.rand(B, T, H, generator=gen)
    o, _ = S.parallel_path_attn(q, k, v, w, beta, g, scale=0.3)
    _close(o, naive_path_attn(q, k, v, w, beta, g, scale=0.3, chunk_size=4))
