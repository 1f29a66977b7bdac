"""A kernelized Granite-4.0-H (`GraniteMoeHybridForCausalLM`) decodes through the compiled whole-model plan
(hf/kernelize_plan_granite.py): Mamba2 blocks and softmax blocks (RoPE or none), each with the shared SwiGLU MLP
and, when configured, a mixture of experts beside it; the embedding, residual and logits multipliers as plan fields.
Through transformers' `generate`, against the UNPATCHED model (transformers' PyTorch code), fp64 and fp32: greedy
tokens identical and logits within 1e-5, sampling with a seed, batch > 1 with rows on different experts,
transformers' cache holding transformers' values, the handoff both ways, left padding stepping aside, the plan
rebuilt or re-read after in-place updates, bf16, torch.compile stepping aside, what the plan does not compute
stepping aside, and a multiplier dropped from the plan changing the logits."""
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "GraniteMoeHybridForCausalLM"):
    pytest.skip(f"the installed transformers ({transformers.__version__}) has no Granite-4.0-H",
                allow_module_level=True)

from linattn.cpu import decode as cpu_decode  # noqa: E402
from linattn.hf import kernelize_plan as plan  # noqa: E402
from linattn.hf.kernelize_plan_granite import describe_model, undescribed_reason  # noqa: E402
from tests.hf import plan_decode as pd  # noqa: E402
from tests.hf.kernelize_models import (  # noqa: E402
    ATTN,
    MAMBA_H,
    transformers_torch_code,  # noqa: F401  (autouse)
)

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler: the compiled kernels are off")

#: Granite-4.0-H's multipliers, away from 1 so that each shows
MULTIPLIERS = dict(embedding_multiplier=3.0, residual_multiplier=0.7, attention_multiplier=0.2, logits_scaling=2.5)


def _pair(dtype=torch.float32, experts=4, rope=True, tied=False, hooked=True, layers=5, attn=(1, 4), **cfg):
    """(unpatched, kernelized) Granite-4.0-H of `layers` blocks, softmax attention at `attn` (Mamba2 blocks with an
    attention block every few, as the released models), 2 groups of B / C, `experts` experts (0: the shared MLP
    alone); the norms, A_log / dt_bias / D, the conv bias and the routers moved off their init values, q / k and the
    Mamba2 input projections scaled up."""
    types = ["full_attention" if i in attn else "linear_attention" for i in range(layers)]
    cfg = transformers.GraniteMoeHybridConfig(**{
        **{k: v for k, v in ATTN.items() if k != "head_dim"}, **MAMBA_H, **MULTIPLIERS,
        **dict(num_hidden_layers=layers, layer_types=types, num_local_experts=experts, num_experts_per_tok=2,
               intermediate_size=16, shared_intermediate_size=32, tie_word_embeddings=tied,
               position_embedding_type="rope" if rope else None), **cfg})
    ref, fast = pd.perturbed_pair(transformers.GraniteMoeHybridForCausalLM, cfg, dtype, hooked,
                                  moved=("norm", "A_log", "dt_bias", ".D", "conv1d.bias", "router"),
                                  scaled=("q_proj", "k_proj", "in_proj", "router"))
    for m in (ref, fast):
        if experts and hasattr(m, "set_experts_implementation"):
            m.set_experts_implementation("eager")   # (torch._grouped_mm takes no fp64)
    return ref, fast


class TestGenerate(pd.GenerateChecks):
    make_pair = staticmethod(_pair)
    COMPILE_PAIR = dict(layers=2, attn=(1,), experts=0)   # a Mamba2 block, a softmax block

    def described_module(self, fast):
        return fast.model.layers[2].shared_mlp.output_linear


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("B,T,n,tied", [(1, 1, 12, False), (3, 9, 70, False), (2, 5, 8, True)])
def test_greedy_generate_matches_the_unpatched_model(B, T, n, tied, dtype, monkeypatch):
    """70 tokens grow the KV buffers past their chunk; batch 3: the rows of a decoded token take different experts
    (seen on the unpatched model's routers)."""
    ref, fast = _pair(dtype, tied=tied)
    assert type(fast).__name__ in plan._ARCHITECTURES
    assert inspect.signature(fast.forward) == inspect.signature(ref.forward)
    routes = []
    for layer in ref.model.layers:
        layer.block_sparse_moe.router.register_forward_hook(lambda m, a, out: routes.append(out[2].clone()))
    pd.check_greedy_generate(ref, fast, B, T, n, monkeypatch)
    if B > 1:
        one_token = [r for r in routes if r.shape[0] == B]
        assert one_token and any(len({tuple(sorted(row.tolist())) for row in r}) > 1 for r in one_token)


@pytest.mark.parametrize("experts,rope", [(0, True), (4, False), (0, False)])
def test_dense_and_without_rope(experts, rope, monkeypatch):
    """The shared MLP alone (no experts: Granite-4.0-H-micro), no position encoding (`position_embedding_type`
    None, the released models')."""
    pd.check_greedy_generate(*_pair(experts=experts, rope=rope), 2, 5, 10, monkeypatch)


@pytest.mark.parametrize("layers,attn", [(3, (0,)), (3, (2,)), (4, (2, 3))])
def test_other_layer_orders(layers, attn, monkeypatch):
    """An attention block first (the scaled embedding straight into it), last, two in a row."""
    pd.check_greedy_generate(*_pair(layers=layers, attn=attn), 2, 4, 8, monkeypatch)


def test_the_blocks_and_multipliers_are_described_as_they_are(monkeypatch):
    """Mamba2 blocks (kind 5) and attention blocks (kind 2, the attention multiplier as the scale), the shared MLP
    as the SwiGLU (one matrix read in place) beside the MoE; the multipliers in the plan."""
    ref, fast = _pair()
    desc, parts = describe_model(fast)
    layers = fast.model.layers
    for i, (bd, part) in enumerate(zip(desc.blocks, parts)):
        assert bd.norm1.weight is layers[i].input_layernorm.weight
        assert bd.norm2.weight is layers[i].post_attention_layernorm.weight
        assert bd.ffn_gate_up is layers[i].shared_mlp.input_linear and bd.ffn == "moe"
        assert bd.moe.gate_up.data_ptr() == layers[i].block_sparse_moe.experts.gate_up_proj.data_ptr()
        assert part[1] == 0.7
        if i in (1, 4):
            assert bd.kind == "softmax" and part[0] is None
            assert bd.attention.scale == 0.2 and bd.attention.rot == bd.attention.head_dim
        else:
            assert bd.kind == "mamba2" and part[0] is layers[i].mamba
    pd.check_greedy_generate(ref, fast, 1, 3, 2, monkeypatch)
    slot = fast._linattn_model_plan
    mp = slot.plan
    assert (mp.emb_scaled, mp.emb_scale, mp.logits_scaled, mp.logits_div) == (1, 3.0, 1, 2.5)
    assert all((p.res_scaled, p.res_a1, p.res_b1, p.res_a2, p.res_b2) == (2, 1.0, 0.7, 1.0, 0.7) for p in slot.keep[0])


def test_cache_objects_hold_transformers_values(monkeypatch):
    """(fp64: transformers' own Mamba2 step leaves fp32 states in an fp64 model, the kernelized model fp64 ones.)"""
    pd.check_cache_values(*_pair(torch.float64), monkeypatch, state_dtype=False)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("watched", ["keys", "state"])
def test_cache_copied_continued_and_advanced_by_transformers_between_calls(dtype, watched, monkeypatch):
    """The handoff both ways: transformers' own tokens (the kernels switched off) between compiled ones, a copied
    cache (its keys and Mamba2 states untouched by the copy's tokens), a generate continued on a returned cache
    (positions taken from the cache: Granite's forward does so)."""
    look = (lambda c: c.layers[1].keys) if watched == "keys" else (lambda c: c.layers[2].recurrent_states[0])
    pd.check_cache_copied_and_advanced(*_pair(dtype), look, monkeypatch)


@pytest.mark.parametrize("name,copied", [
    ("model.layers.0.input_layernorm.weight", False), ("model.layers.1.post_attention_layernorm.weight", False),
    ("model.layers.1.self_attn.k_proj.weight", False), ("model.layers.0.mamba.A_log", True),
    ("model.layers.2.mamba.in_proj.weight", False), ("model.layers.3.shared_mlp.input_linear.weight", False),
    ("model.layers.3.block_sparse_moe.router.weight", False),
    ("model.layers.4.block_sparse_moe.experts.gate_up_proj", False), ("model.norm.weight", False)])
def test_in_place_update_of_a_weight_is_read(name, copied, monkeypatch):
    """A weight updated in place between tokens: the next token reads the new value (-exp(A_log) is a copy: the
    plan rebuilds; the rest is read in place)."""
    pd.check_in_place_update(*_pair(), name, copied, monkeypatch)


@pytest.mark.parametrize("owner,name", [("model", "embedding_multiplier"), ("layer", "residual_multiplier")])
def test_a_changed_multiplier_rebuilds_the_plan(owner, name, monkeypatch):
    """A multiplier the modules hold, set to another value between tokens: the guard fails, the next token is the
    unpatched model's with the new value."""
    pd.check_changed_between_tokens(
        *_pair(), lambda m: setattr(m.model if owner == "model" else m.model.layers[3], name, 1.6), True, monkeypatch)


def test_bf16_dense(monkeypatch):
    """bf16 weights without experts (the shared MLP alone): the logits within bf16's rounding."""
    pd.check_bf16(*_pair(torch.bfloat16, experts=0), torch.bfloat16, monkeypatch)


@pytest.mark.parametrize("cfg,why", [(dict(attention_bias=True), "bias"),
                                     (dict(mamba_proj_bias=True, time_step_limit=(0.0, 0.5)), "time_step_limit"),
                                     (dict(output_router_logits=True), "router logits")])
def test_what_the_plan_does_not_compute_steps_aside(cfg, why, monkeypatch):
    """Attention biases, a clamped time step, router logits asked for: not described (the reason given), not
    hooked, and the kernelized model decodes as the unpatched one."""
    ref, fast = _pair(hooked=False, **cfg)
    pd.check_not_described(ref, fast, undescribed_reason, why, describe_model,
                           not cfg.get("output_router_logits"), monkeypatch)


@pytest.mark.parametrize("where,field,value", [
    ("model", "emb_scaled", 0),        # the embedding multiplier dropped
    ("model", "logits_scaled", 0),     # the logits not divided
    ("block", "res_scaled", 0),        # the residual multiplier dropped from every block
])
@pytest.mark.parametrize("experts", [0, 4])
def test_a_multiplier_dropped_from_the_plan_changes_the_logits(where, field, value, experts):
    """What the comparisons above check is what the multipliers do: with one of them dropped from the plan, the
    logits leave the unpatched model's."""
    def drop(blocks, model_plan):
        for p in [model_plan] if where == "model" else blocks:
            setattr(p, field, value)

    pd.check_broken_plan(*_pair(experts=experts), drop)
