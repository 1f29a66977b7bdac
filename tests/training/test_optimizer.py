"""The training optimizer's implementation: the fused AdamW where torch has it, checked against AdamW written
from its formulas in float64, and the per-operator form where it does not apply."""
import math

import pytest
import torch

from linattn.models import LanguageModel, LMConfig
from linattn.training import TrainConfig, make_optimizer
from linattn.training.schedule import adamw_implementation


def _adamw_reference(p0, grads, lr, betas, eps, wd):
    """AdamW (decoupled weight decay, bias-corrected moments) in float64, from the formulas."""
    p, m, v = p0.double().clone(), torch.zeros_like(p0, dtype=torch.float64), torch.zeros_like(p0, dtype=torch.float64)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        p = p * (1 - lr * wd)
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        m_hat, v_hat = m / (1 - betas[0] ** t), v / (1 - betas[1] ** t)
        p = p - lr * m_hat / (v_hat.sqrt() + eps)
    return p


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_make_optimizer_fused_on_cpu_matches_the_formulas(dtype):
    torch.manual_seed(0)
    model = LanguageModel(LMConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2)).to(dtype)
    cfg = TrainConfig(lr=1e-2, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8)
    opt = make_optimizer(model, cfg)
    assert all(g["fused"] for g in opt.param_groups)
    params = [p for g in opt.param_groups for p in g["params"]]
    start = [p.detach().clone() for p in params]
    grads = [[torch.randn_like(p) * s for p in params] for s in (1.0, 1e-3, 1e3)]  # tiny and huge steps too
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for group in opt.param_groups:
        for p in group["params"]:
            i = next(j for j, q in enumerate(params) if q is p)
            ref = _adamw_reference(start[i], [gs[i] for gs in grads], cfg.lr, (cfg.beta1, cfg.beta2), cfg.eps,
                                   group["weight_decay"])
            assert torch.allclose(p.double(), ref, rtol=tol, atol=tol * cfg.lr), (i, (p.double() - ref).abs().max())


def test_fused_adamw_keeps_nan_and_inf_gradients_visible():
    """A non-finite gradient is not hidden by the fused kernel (the trainer checks gradients before stepping,
    but a direct user of make_optimizer sees the same as with the per-operator form)."""
    w = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([w], lr=0.1, **adamw_implementation([w]))
    w.grad = torch.tensor([1.0, math.nan, math.inf, -1.0])
    opt.step()
    assert torch.isfinite(w[[0, 3]]).all() and not torch.isfinite(w[[1, 2]]).any()


def test_adamw_implementation_falls_back_where_fused_does_not_apply():
    assert adamw_implementation([torch.nn.Parameter(torch.ones(2))]) == {"fused": True}
    assert adamw_implementation([]) == {"foreach": False}
    meta = torch.nn.Parameter(torch.ones(2, device="meta"))
    assert adamw_implementation([torch.nn.Parameter(torch.ones(2)), meta]) == {"foreach": False}
    ints = torch.nn.Parameter(torch.ones(2, dtype=torch.int64), requires_grad=False)
    assert adamw_implementation([ints]) == {"foreach": False}
