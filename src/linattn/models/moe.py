"""Mixture of SwiGLU experts with a softmax top-k router and ELA's routing-score bias.

Routing: p = softmax(router(x)) over E experts; the top-k experts of each token are kept and their
scores renormalised to sum to 1 (S_e). Each expert is a bias-free SwiGLU.

Routing-score bias (ELA section V-A): every expert owns a learnable "label vector" B_e, the
expert's row of the router's weight matrix (the key the router queries with x). It is used as
the expert's bias, so the router's weights also receive the gradient of the output:

    "none"   y = sum_{e in topk} S_e f_e(x)
    "eq14"   y = sum_{e in topk} S_e f_e(x) + B_e        (eq. 14)
    "eq15"   y = sum_{e in topk} S_e (f_e(x) + B_e)      (eq. 15)

Load-balancing loss (Switch Transformer): aux = coef * E * sum_e f_e P_e, with f_e the fraction
of the N*k (token, slot) assignments that go to expert e and P_e the mean router probability;
it is 1 * coef for a perfectly balanced router.

Dispatch is vectorised: assignments are sorted by expert, each expert runs once on its tokens
(a loop over experts, not tokens), and the results are scattered back with index_add_.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import LinattnError

MOE_BIASES = ("none", "eq14", "eq15")


class Routing(NamedTuple):
    probs: torch.Tensor    # [N, E] router probabilities (fp32)
    experts: torch.Tensor  # [N, k] chosen experts
    weights: torch.Tensor  # [N, k] their renormalised scores S_e (fp32)


class MoE(nn.Module):
    """Top-k mixture of SwiGLU experts. forward(x `[B, T, d]`) -> (y `[B, T, d]`, aux_loss scalar).

    Args: d_model; n_experts; top_k; hidden (expert width, default d_model as in ELA);
    bias "none" | "eq14" | "eq15"; aux_loss_coef; renormalize (S_e = top-k scores / their sum);
    init_std (expert weights; w_down uses out_std when given).
    """

    def __init__(self, d_model: int, n_experts: int = 4, top_k: int = 2, hidden: Optional[int] = None, *,
                 bias: str = "none", aux_loss_coef: float = 0.01, renormalize: bool = True,
                 init_std: float = 0.02, out_std: Optional[float] = None):
        super().__init__()
        if bias not in MOE_BIASES:
            raise LinattnError(f"bias must be one of {MOE_BIASES}, got {bias!r}")
        if not 1 <= top_k <= n_experts:
            raise LinattnError(f"top_k must lie in [1, n_experts = {n_experts}], got {top_k}")
        self.d_model, self.n_experts, self.top_k = int(d_model), int(n_experts), int(top_k)
        self.hidden = int(hidden) if hidden is not None else self.d_model
        self.bias_mode, self.aux_loss_coef, self.renormalize = bias, float(aux_loss_coef), bool(renormalize)
        self.router = nn.Linear(d_model, n_experts, bias=True)
        self.w_gate_up = nn.Parameter(torch.empty(n_experts, d_model, 2 * self.hidden))
        self.w_down = nn.Parameter(torch.empty(n_experts, self.hidden, d_model))
        self.init_std, self.out_std = float(init_std), out_std
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.router.weight, std=self.init_std)
        nn.init.zeros_(self.router.bias)
        nn.init.normal_(self.w_gate_up, std=self.init_std)
        nn.init.normal_(self.w_down, std=self.out_std if self.out_std is not None else self.init_std)

    @property
    def labels(self) -> torch.Tensor:
        """The experts' label vectors B_e `[E, d]` (the router's weight rows)."""
        return self.router.weight

    def route(self, x: torch.Tensor) -> Routing:
        """Routing of tokens x `[N, d]`."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        top_p, top_e = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            top_p = top_p / (top_p.sum(-1, keepdim=True) + 1e-9)
        return Routing(probs, top_e, top_p)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e's SwiGLU on x `[n, d]`."""
        a, b = (x @ self.w_gate_up[e].to(x.dtype)).chunk(2, dim=-1)
        return (F.silu(a) * b) @ self.w_down[e].to(x.dtype)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        xf = x.reshape(-1, self.d_model)
        N, E, k = xf.shape[0], self.n_experts, self.top_k
        r = self.route(xf)
        flat_e = r.experts.reshape(-1)                                    # [N*k]
        flat_w = r.weights.reshape(-1, 1).to(x.dtype)                     # [N*k, 1]
        flat_tok = torch.arange(N, device=x.device).repeat_interleave(k)  # [N*k]
        order = torch.argsort(flat_e, stable=True)
        counts = torch.bincount(flat_e, minlength=E).tolist()
        tok_sorted, w_sorted = flat_tok[order], flat_w[order]
        out = torch.zeros_like(xf)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            tok, w = tok_sorted[start:start + n], w_sorted[start:start + n]
            start += n
            h = self.expert(e, xf[tok])
            if self.bias_mode == "eq14":
                y = w * h + self.labels[e].to(x.dtype)
            elif self.bias_mode == "eq15":
                y = w * (h + self.labels[e].to(x.dtype))
            else:
                y = w * h
            out.index_add_(0, tok, y)
        # load balancing: fraction of assignments f_e and mean probability P_e per expert
        frac = torch.bincount(flat_e, minlength=E).float() / float(N * k)
        aux = self.aux_loss_coef * E * (frac * r.probs.mean(0)).sum()
        return out.view(shape), aux

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_experts={self.n_experts}, top_k={self.top_k}, hidden={self.hidden}, "
                f"bias={self.bias_mode!r}, aux_loss_coef={self.aux_loss_coef}")
