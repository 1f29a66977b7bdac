"""Router mode 2 of the compiled MoE feed-forward (csrc/decode_moe.h, `cpu/decode.moe_route_grouped`):
DeepSeek-V3's sigmoid router with an expert-score correction bias for the choice, grouped top-k and a routed
scaling factor, as Kimi Linear's and Bailing hybrid's routers compute it, against transformers' own
`KimiLinearTopkRouter` (its weight the identity, so its logits are the rows given) on tie-heavy rows."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from linattn.cpu import decode as cpu_decode  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler: the compiled kernels are off")


def _router(E, k, G, kg, norm, scale, bias):
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearTopkRouter
    cfg = transformers.KimiLinearConfig(hidden_size=E, num_experts=E, num_experts_per_token=k, num_expert_group=G,
                                        topk_group=kg, moe_renormalize=norm, routed_scaling_factor=scale)
    r = KimiLinearTopkRouter(cfg)
    with torch.no_grad():
        r.weight.copy_(torch.eye(E))
        r.e_score_correction_bias.copy_(bias)
    return r


def _torch_route(router, lg):
    with torch.no_grad():
        _, w, i = router(lg)
    o = i.sort(-1)
    return o.values, w.gather(-1, o.indices)


@pytest.mark.parametrize("E,k,G,kg", [(8, 2, 1, 1), (16, 4, 4, 2), (64, 6, 8, 3), (256, 8, 8, 4), (512, 8, 1, 1),
                                      (160, 6, 1, 1), (32, 3, 16, 5)])
@pytest.mark.parametrize("norm", [True, False])
def test_route_matches_transformers_router_with_ties(E, k, G, kg, norm):
    """Logits and biases drawn from a few values (most scores and group scores tie): the same experts as
    transformers' router and the same weights. k * 64 <= E takes ATen's heap selection, else its nth_element."""
    g = torch.Generator().manual_seed(E * 100 + k + G)
    lg = torch.tensor([-1.0, 0.0, 0.5, 1.0])[torch.randint(0, 4, (64, E), generator=g)]
    bias = torch.tensor([0.0, 0.25])[torch.randint(0, 2, (E,), generator=g)]
    router = _router(E, k, G, kg, norm, 2.5, bias)
    idx, w = cpu_decode.moe_route_grouped(lg, bias, k, G, kg, norm, 2.5)
    want_i, want_w = _torch_route(router, lg)
    assert torch.equal(idx, want_i)
    torch.testing.assert_close(w, want_w, rtol=1e-6, atol=1e-7)
    lowest = torch.topk(torch.sigmoid(lg) + bias - torch.arange(E) * 1e-6, k, -1).indices.sort(-1).values
    if G == 1 and k * 64 > E:   # (nth_element keeps neither end of a tie: a lowest-index tie-break fails here)
        assert not torch.equal(want_i, lowest)


def test_bias_chooses_and_scale_weighs():
    """The correction bias changes which experts are taken but not their weights (sigmoid of the logits); the
    scaling factor multiplies the weights; groups restrict the choice."""
    g = torch.Generator().manual_seed(5)
    E, k = 16, 2
    lg = torch.randn(32, E, generator=g)
    zero = torch.zeros(E)
    bias = torch.zeros(E)
    bias[3] = 10.0   # expert 3 always chosen
    i0, w0 = cpu_decode.moe_route_grouped(lg, zero, k, 1, 1, False, 1.0)
    i1, w1 = cpu_decode.moe_route_grouped(lg, bias, k, 1, 1, False, 1.0)
    assert (i1 == 3).any(-1).all() and not (i0 == 3).any(-1).all()
    torch.testing.assert_close(w1, torch.sigmoid(lg).gather(-1, i1))
    _, w2 = cpu_decode.moe_route_grouped(lg, bias, k, 1, 1, False, 2.5)
    torch.testing.assert_close(w2, 2.5 * w1)
    i3, _ = cpu_decode.moe_route_grouped(lg, zero, k, 4, 1, False, 1.0)
    assert ((i3 // 4)[:, 0] == (i3 // 4)[:, 1]).all()   # one group kept: both experts in it
    for R, want in ((_router(E, k, 1, 1, False, 2.5, bias), (i1, 2.5 * w1)),):
        got = _torch_route(R, lg)
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])


def test_route_refuses_bad_input():
    with pytest.raises(ValueError, match=r"logits must be float32 \[R, E\]"):
        cpu_decode.moe_route_grouped(torch.zeros(3, 4, dtype=torch.float64), torch.zeros(4), 2, 1, 1, True, 1.0)
    with pytest.raises(ValueError, match=r"bias must be float32 \[4\]"):
        cpu_decode.moe_route_grouped(torch.zeros(3, 4), torch.zeros(5), 2, 1, 1, True, 1.0)
    with pytest.raises(ValueError, match="groups must divide"):
        cpu_decode.moe_route_grouped(torch.zeros(3, 6), torch.zeros(6), 2, 4, 1, True, 1.0)
    with pytest.raises(ValueError, match=r"k must be in \[1, 4\]"):
        cpu_decode.moe_route_grouped(torch.zeros(3, 8), torch.zeros(8), 5, 2, 1, True, 1.0)
