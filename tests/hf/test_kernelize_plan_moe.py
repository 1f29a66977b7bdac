"""A kernelized Qwen3-Next or Qwen3.5-MoE with mixture-of-experts feed-forwards decodes through the compiled
whole-model plan (hf/kernelize_plan.py, csrc/decode_moe.h), against the UNPATCHED model (transformers' PyTorch
code): greedy tokens identical and logits within 1e-5 (fp32, fp64), bf16 close, batch > 1 with rows taking
different experts, dense and MoE layers mixed (`mlp_only_layers`), with and without the shared expert, with and
without renormalised top-k probabilities, exactly tied router scores (torch.topk's choice among them), left padding,
sampling with a seed, transformers' own decode and the plan handing the cache to each other, torch.compile stepping
aside. The routing itself (`cpu/decode.moe_route`) against torch's softmax and topk."""
import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

from linattn.cpu import decode as cpu_decode  # noqa: E402
from linattn.hf import kernelize, kernelize_plan as kp  # noqa: E402
from tests.helpers import CompiledDecodeCalls  # noqa: E402
from tests.hf import plan_decode as pd  # noqa: E402
from tests.hf.kernelize_models import (  # noqa: E402
    ATTN,
    GDN,
    transformers_torch_code,  # noqa: F401  (autouse)
)

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler: the compiled kernels are off")

ARCHS = ("qwen3_next", "qwen3_5_moe")
LAYERS = ("linear_attention", "full_attention", "linear_attention", "full_attention")
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)


def _config(arch, shared=16, norm_topk=True, layers=LAYERS, **kw):
    """`layers` (4, 2 of them softmax attention); 8 experts, top-2. Qwen3-Next: layer 1 dense (`mlp_only_layers`),
    the others MoE; `shared` 0: no shared expert."""
    base = {k: v for k, v in ATTN.items() if k != "intermediate_size"} if arch == "qwen3_5_moe" else dict(ATTN)
    common = dict(**base, **GDN, **MOE, num_hidden_layers=len(layers), layer_types=list(layers),
                  shared_expert_intermediate_size=shared, **kw)
    if arch == "qwen3_next":
        if not hasattr(transformers, "Qwen3NextForCausalLM"):
            pytest.skip(f"the installed transformers ({transformers.__version__}) has no Qwen3-Next")
        cfg = transformers.Qwen3NextConfig(**common, decoder_sparse_step=1, mlp_only_layers=[1],
                                           norm_topk_prob=norm_topk, partial_rotary_factor=0.5)
        return cfg, transformers.Qwen3NextForCausalLM
    if not hasattr(transformers, "Qwen3_5MoeForCausalLM"):
        pytest.skip(f"the installed transformers ({transformers.__version__}) has no Qwen3.5-MoE")
    return transformers.Qwen3_5MoeTextConfig(**common), transformers.Qwen3_5MoeForCausalLM


def _pair(arch="qwen3_next", dtype=torch.float32, **kw):
    """(unpatched, kernelized): the norms, A_log / dt_bias, the routers and shared-expert gates moved off their init
    values (router logits of order 1: the top-k choice is not decided by rounding), q / k scaled up."""
    cfg, cls = _config(arch, **kw)
    return pd.perturbed_pair(cls, cfg, dtype, moved=("norm", "A_log", "dt_bias", "mlp.gate.", "shared_expert_gate"),
                             scaled=("q_proj", "k_proj", "in_proj_qkvz", "mlp.gate."))


class TestGenerate(pd.GenerateChecks):
    @pytest.fixture(params=ARCHS)
    def pair(self, request):
        return functools.partial(_pair, request.param)

    COMPILE_PAIR = dict(layers=LAYERS[:2])   # GDN and softmax; Qwen3-Next's layer 1 dense, layer 0 MoE

    def described_module(self, fast):
        return fast.model.layers[0].mlp.experts

    def test_the_hook_returns_the_unpatched_forwards_output_class(self, pair, monkeypatch):
        """`MoeCausalLMOutputWithPast`, its aux loss and router logits None as the unpatched forward leaves them
        without `output_router_logits`."""
        got, want = pd.check_output_class(*pair(), monkeypatch)
        assert type(got) is transformers.modeling_outputs.MoeCausalLMOutputWithPast
        assert got.aux_loss is want.aux_loss is None and got.router_logits is want.router_logits is None


def _routes(model):
    """The top-k indices every MoE router of `model` returns, per call (a forward hook on the routers)."""
    seen = []
    for layer in model.model.layers:
        gate = layer.mlp._modules.get("gate")
        if gate is not None and type(gate).__name__.endswith("TopKRouter"):
            gate.register_forward_hook(lambda m, a, out: seen.append(out[2].clone()))
    return seen


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("B,T,n", [(1, 1, 10), (3, 7, 40)])
def test_greedy_generate_matches_the_unpatched_model(B, T, n, arch, monkeypatch):
    """Batch 3: the rows of a decoded token take different experts (seen on the unpatched model's routers)."""
    ref, fast = _pair(arch)
    routes = _routes(ref)
    pd.check_greedy_generate(ref, fast, B, T, n, monkeypatch)
    assert type(fast.model.layers[0].mlp).__name__.endswith("SparseMoeBlock")
    if B > 1:
        one_token = [r for r in routes if r.shape[0] == B]
        assert one_token and any(len({tuple(row.tolist()) for row in r}) > 1 for r in one_token)


@pytest.mark.parametrize("arch", ARCHS)
def test_fp64_logits_within_1e_5(arch, monkeypatch):
    """(transformers' default experts kernel, torch._grouped_mm, takes no fp64: its eager loop then)"""
    pd.check_greedy_generate(*_pair(arch, torch.float64, experts_implementation="eager"), 2, 5, 12, monkeypatch)


@pytest.mark.parametrize("shared,norm_topk", [(0, True), (16, False), (0, False)])
def test_without_shared_expert_or_renormalisation(shared, norm_topk, monkeypatch):
    """Qwen3-Next's config: no shared expert (`shared_expert_intermediate_size` 0), raw top-k probabilities
    (`norm_topk_prob` False)."""
    pd.check_greedy_generate(*_pair(shared=shared, norm_topk=norm_topk), 2, 5, 12, monkeypatch)


def test_exactly_tied_router_scores_take_torch_topks_experts(monkeypatch):
    """Router rows 1..6 equal (their probabilities tie exactly) and the experts' weights different: a tie broken
    otherwise than torch.topk breaks it (its libstdc++ selection, not the lowest index) changes the logits."""
    ref, fast = _pair()
    with torch.no_grad():
        for m in (ref, fast):
            for layer in m.model.layers:
                gate = layer.mlp._modules.get("gate")
                if gate is not None:
                    gate.weight[1:7] = gate.weight[1]
                    gate.weight[0].mul_(-1.0)
    routes = _routes(ref)
    pd.check_greedy_generate(ref, fast, 2, 5, 8, monkeypatch)
    tied = [set(row.tolist()) for r in routes for row in r]
    assert any(s <= set(range(1, 7)) and s != {1, 2} for s in tied)   # (not the lowest indices among the tie)


def test_cache_objects_hold_transformers_values(monkeypatch):
    pd.check_cache_values(*_pair(), monkeypatch)


@pytest.mark.parametrize("arch", ARCHS)
def test_handoff_between_transformers_decode_and_the_plan(arch, monkeypatch):
    """Tokens decoded by transformers' own code between compiled ones (both ways), a copied cache, a continued
    generate: the unpatched model's logits throughout."""
    pd.check_cache_copied_and_advanced(*_pair(arch), lambda c: c.layers[1].keys, monkeypatch)


@pytest.mark.parametrize("name,copied", [("model.layers.0.mlp.experts.gate_up_proj", False),
                                         ("model.layers.2.mlp.experts.down_proj", False),
                                         ("model.layers.0.mlp.gate.weight", False),
                                         ("model.layers.0.mlp.shared_expert_gate.weight", False),
                                         ("model.layers.2.mlp.shared_expert.up_proj.weight", False)])
def test_in_place_update_of_an_expert_weight(name, copied, monkeypatch):
    """The router, the experts, the shared gate and the shared expert's gate | up parts are read in place: the plan
    stays valid and reads the new values."""
    pd.check_in_place_update(*_pair(), name, copied, monkeypatch)


def test_router_logits_requested_steps_aside(monkeypatch):
    """`output_router_logits` in the config: the plan returns no router logits, so transformers' forward runs."""
    ref, fast = _pair(output_router_logits=True)
    assert "router logits" in kp._describe(fast)
    ids = pd.prompt(2, 4)
    calls = CompiledDecodeCalls(monkeypatch)
    got, want = (pd.generate(m, ids, 4) for m in (fast, ref))
    assert calls.model == 0 and torch.equal(got.sequences, want.sequences)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_served_moe_models_are_hooked(arch):
    from tests.hf.kernelize_models import build
    assert kernelize(build(arch).eval()).compiled_decode


# -- the routing in C ---------------------------------------------------------------------------------------------

def _torch_route(logits, k, norm):
    p = torch.softmax(logits, -1, dtype=torch.float)
    v, i = torch.topk(p, k, -1)
    if norm:
        v = v / v.sum(-1, keepdim=True)
    o = i.sort(-1)
    return o.values, v.gather(-1, o.indices)


@pytest.mark.parametrize("E,k", [(8, 2), (16, 3), (60, 4), (128, 2), (512, 8), (512, 10)])
@pytest.mark.parametrize("norm", [True, False])
def test_route_matches_torch_topk_with_ties(E, k, norm):
    """Logits drawn from 3 values (most probabilities tie) and a NaN row: the same experts as torch.topk and the
    same weights (renormalised or not). k * 64 <= E takes ATen's heap selection (a tie keeps the lowest indices),
    else its nth_element (neither the lowest nor the highest: checked, so a simpler tie-break fails here)."""
    g = torch.Generator().manual_seed(E * 100 + k)
    lg = torch.tensor([0.0, 0.5, 1.0])[torch.randint(0, 3, (64, E), generator=g)]
    lg[5, 3] = float("nan")
    idx, w = cpu_decode.moe_route(lg, k, norm)
    want_i, want_w = _torch_route(lg, k, norm)
    assert torch.equal(idx, want_i)
    torch.testing.assert_close(w, want_w, rtol=1e-6, atol=1e-7, equal_nan=True)
    lowest = torch.topk(torch.softmax(lg, -1) - torch.arange(E) * 1e-7, k, -1).indices.sort(-1).values
    highest = torch.topk(torch.softmax(lg, -1) + torch.arange(E) * 1e-7, k, -1).indices.sort(-1).values
    assert not torch.equal(want_i, highest)
    if k * 64 > E:   # (nth_element keeps neither end of a tie; the heap selection keeps the lowest indices)
        assert not torch.equal(want_i, lowest)
    if norm:
        raw = cpu_decode.moe_route(lg, k, False)[1]
        assert not torch.allclose(raw[:5], w[:5])


def test_route_refuses_bad_input():
    with pytest.raises(ValueError, match=r"logits must be float32 \[R, E\]"):
        cpu_decode.moe_route(torch.zeros(3, 4, dtype=torch.float64), 2, True)
    with pytest.raises(ValueError, match=r"k must be in \[1, E = 4\]"):
        cpu_decode.moe_route(torch.zeros(3, 4), 5, True)
