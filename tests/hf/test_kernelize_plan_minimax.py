"""A kernelized MiniMax decodes through the compiled whole-model plan (hf/kernelize_plan_minimax.py): lightning
blocks (kind 8) and softmax blocks on the layer pattern `layer_types`, each with MiniMax's sparse MoE feed-forward,
in MiniMax's scaled residual order (alpha / beta of each layer type and of the MLP moved off 1). Through
transformers' `generate`, against the UNPATCHED `MiniMaxForCausalLM` (transformers' PyTorch code), fp64 and fp32:
greedy tokens identical and logits within 1e-5, sampling with a seed, batch 1-3, beam search, `MiniMaxCache`
holding transformers' values (lightning states in its `linear_cache`, keys and values in its layers), the handoff
both ways (a cache copied, advanced by transformers' own code between compiled tokens, continued by `generate`),
left padding (the plan steps aside), an in-place weight update read, bf16, torch.compile and hooks stepping aside;
a planted error (another slope, alpha and beta swapped) fails the comparison."""
import copy
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "MiniMaxForCausalLM"):
    pytest.skip(f"the installed transformers ({transformers.__version__}) has no MiniMax", allow_module_level=True)

from linattn.cpu import decode as cpu_decode  # noqa: E402
from linattn.hf import (  # noqa: E402
    kernelize_plan as plan,
    kernelize_plan_minimax as mx,
)
from tests.helpers import CompiledDecodeCalls  # noqa: E402
from tests.hf import plan_decode as pd  # noqa: E402
from tests.hf.kernelize_models import (  # noqa: E402
    ATTN,
    transformers_torch_code,  # noqa: F401  (autouse)
)

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler: the compiled kernels are off")

#: MiniMax-Text-01's pattern, shortened: lightning blocks with a softmax block among them (layer 0 lightning, as
#: there: transformers then takes every cached token's position as 0, `kernelize_plan_minimax.position`)
PATTERN = ("linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention")
FACTORS = dict(full_attn_alpha_factor=1.3, full_attn_beta_factor=0.7, linear_attn_alpha_factor=0.9,
               linear_attn_beta_factor=1.2, mlp_alpha_factor=1.1, mlp_beta_factor=0.8)


def _pair(dtype=torch.float32, tied=False, hooked=True, pattern=PATTERN, **cfg):
    """(unpatched, kernelized) MiniMax of `pattern`, an MoE of 4 experts (top 2) in every block; the norms moved off
    their init values, q / k / v and the router scaled up so that the norms, the softmax, RoPE and the experts'
    choice show. fp64: transformers' eager experts loop (torch._grouped_mm takes no fp64)."""
    base = {k: v for k, v in ATTN.items() if k != "intermediate_size"}
    cfg = transformers.MiniMaxConfig(**{**base, **FACTORS, **cfg}, intermediate_size=24, num_local_experts=4,
                                     num_experts_per_tok=2, block_size=4, num_hidden_layers=len(pattern),
                                     layer_types=list(pattern), tie_word_embeddings=tied,
                                     **({"experts_implementation": "eager"} if dtype == torch.float64 else {}))
    return pd.perturbed_pair(transformers.MiniMaxForCausalLM, cfg, dtype, hooked, moved=("norm",),
                             scaled=("qkv_proj", "q_proj", "k_proj", "gate.weight"))


class TestGenerate(pd.GenerateChecks):
    make_pair = staticmethod(_pair)
    COMPILE_PAIR = dict(pattern=("linear_attention", "full_attention"))

    def described_module(self, fast):
        return fast.model.layers[1].self_attn.output_gate


@pytest.mark.parametrize("dtype,B,T,n,tied", [
    (torch.float64, 1, 1, 12, False), (torch.float64, 3, 9, 20, False), (torch.float64, 2, 5, 8, True),
    (torch.float32, 1, 1, 12, False), (torch.float32, 3, 9, 70, False), (torch.float32, 2, 5, 8, True)])
def test_greedy_generate_matches_the_unpatched_model(dtype, B, T, n, tied, monkeypatch):
    """Prompts shorter and longer than a lightning block (transformers' chunked prefill); 70 tokens grow the KV
    buffers past their chunk (fp32 only: transformers' fp64 experts are an eager loop)."""
    ref, fast = _pair(dtype, tied=tied)
    assert type(fast).__name__ in plan._ARCHITECTURES
    assert inspect.signature(fast.forward) == inspect.signature(ref.forward)
    pd.check_greedy_generate(ref, fast, B, T, n, monkeypatch)


@pytest.mark.parametrize("pattern", [("full_attention", "linear_attention", "linear_attention"),
                                     ("linear_attention", "full_attention"),
                                     ("full_attention", "full_attention", "linear_attention")])
def test_other_layer_orders(pattern, monkeypatch):
    """A softmax block first (the cache's length is then the true one: tokens rotated at their positions), last,
    two in a row."""
    pd.check_greedy_generate(*_pair(pattern=pattern), 2, 4, 8, monkeypatch)


def test_the_blocks_are_described_as_they_are():
    """Lightning blocks (their layer and the fused [qkv | gate] rows read in place, the layer type's factors),
    softmax blocks (full RoPE, no q / k norm, no gate), the MoE of every block (renormalised top-k, no shared
    expert)."""
    _, fast = _pair()
    desc, parts = mx.describe_model(fast)
    layers, cfg = fast.model.layers, fast.config
    for i, (bd, part) in enumerate(zip(desc.blocks, parts)):
        assert bd.norm1.weight is layers[i].input_layernorm.weight
        assert bd.norm2.weight is layers[i].post_attention_layernorm.weight
        assert bd.ffn == "moe" and bd.ffn_down is None and bd.moe.norm_topk and bd.moe.top_k == 2
        assert bd.moe.router is not None and bd.moe.shared_gate is None
        mlp = (cfg.mlp_alpha_factor, cfg.mlp_beta_factor)
        if PATTERN[i] == "full_attention":
            att = bd.attention
            assert bd.kind == "softmax" and att.rot == att.head_dim and att.q_norm is None and att.gate is None
            assert part.factors == (cfg.full_attn_alpha_factor, cfg.full_attn_beta_factor) + mlp
        else:
            m = layers[i].self_attn
            assert bd.kind == "lightning" and part.layer is m
            assert [w.data_ptr() for w in part.W.parts] == [m.qkv_proj.weight.data_ptr(),
                                                             m.output_gate.weight.data_ptr()]
            assert part.factors == (cfg.linear_attn_alpha_factor, cfg.linear_attn_beta_factor) + mlp


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cache_holds_transformers_values(dtype, monkeypatch):
    """After compiled tokens through `generate`: the lightning states (`linear_cache`, of the model's dtype), the
    softmax layers' keys and values, the length, as transformers' own decode leaves them."""
    ref, fast = _pair(dtype)
    ids = pd.prompt(2, 6)
    calls = CompiledDecodeCalls(monkeypatch)
    got, want = (pd.generate(m, ids, 5).past_key_values for m in (fast, ref))
    assert calls.model == 4
    assert type(got) is type(want) and len(got.linear_cache) == len(want.linear_cache)
    for i, kind in enumerate(PATTERN):
        if kind == "linear_attention":
            assert got.linear_cache[i].dtype == want.linear_cache[i].dtype == dtype
            torch.testing.assert_close(got.linear_cache[i], want.linear_cache[i], rtol=1e-5, atol=1e-6)
        else:
            assert got.layers[i].keys.shape[2] == 10
            torch.testing.assert_close(got.layers[i].keys, want.layers[i].keys, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got.layers[i].values, want.layers[i].values, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("watched", ["keys", "state"])
def test_cache_copied_continued_and_advanced_by_transformers_between_calls(dtype, watched, monkeypatch):
    """The handoff both ways: transformers' own tokens (the kernels switched off) between compiled ones, a copied
    cache (its keys and lightning states untouched by the copy's tokens), a generate continued on a returned
    cache."""
    look = (lambda c: c.layers[2].keys) if watched == "keys" else (lambda c: c.linear_cache[1])
    pd.check_cache_copied_and_advanced(*_pair(dtype), look, monkeypatch)


def test_position_ids_are_taken_as_transformers_takes_them(monkeypatch):
    """Without position ids a token is rotated at the cache's `get_seq_length()` (layer 0's: 0 here), with them at
    theirs: both through the plan, both the unpatched model's logits; rows at different positions step aside."""
    ref, fast = _pair()
    ids = pd.prompt(2, 5)
    calls = CompiledDecodeCalls(monkeypatch)
    with torch.no_grad():
        caches = [m(ids, use_cache=True).cache for m in (fast, ref)]
        for pos in (None, torch.full((1, 1), 5), torch.tensor([[5], [6]])):
            kw = {} if pos is None else {"position_ids": pos}
            lg = [m(ids[:, -1:], cache=copy.deepcopy(c), **kw).logits for m, c in zip((fast, ref), caches)]
            assert pd.close(lg[0], lg[1])
    assert calls.model == 2


@pytest.mark.parametrize("name,copied", [
    ("model.layers.0.input_layernorm.weight", False), ("model.layers.1.post_attention_layernorm.weight", False),
    ("model.layers.0.self_attn.qkv_proj.weight", False), ("model.layers.1.self_attn.output_gate.weight", False),
    ("model.layers.3.self_attn.norm.weight", False), ("model.layers.3.self_attn.out_proj.weight", False),
    ("model.layers.2.self_attn.k_proj.weight", False), ("model.layers.4.mlp.gate.weight", False),
    ("model.layers.2.mlp.experts.gate_up_proj", False), ("model.norm.weight", False)])
def test_in_place_update_of_a_weight_is_read(name, copied, monkeypatch):
    pd.check_in_place_update(*_pair(), name, copied, monkeypatch)


@pytest.mark.parametrize("cfg,why", [(dict(sliding_window=3), "sliding window"),
                                     (dict(hidden_act="gelu"), "SiLU"),
                                     (dict(output_router_logits=True), "output_router_logits")])
def test_what_the_plan_does_not_compute_steps_aside(cfg, why, monkeypatch):
    """A sliding window, another activation, router logits asked for: not described (the reason given), not
    hooked, and the kernelized model decodes as the unpatched one."""
    ref, fast = _pair(hooked=False, **cfg)
    pd.check_not_described(ref, fast, mx.undescribed_reason, why, mx.describe_model,
                           "output_router_logits" not in cfg, monkeypatch)


@pytest.mark.parametrize("planted", ["slope", "factors_swapped"])
def test_a_planted_error_fails_the_comparison(planted, monkeypatch):
    """The greedy comparison tells the plan's parts apart: a plan with each lightning layer's decay squared (another
    slope), or each block's alpha and beta swapped, gives logits the check rejects."""
    ref, fast = _pair()
    inner = mx.block_plan

    def planted_plan(part, bd, B, d, wdt):
        p = inner(part, bd, B, d, wdt)
        if planted == "slope" and type(part) is mx._Lightning:
            decay = torch.exp(-2 * part.layer.slope_rate.detach()).reshape(-1).to(torch.float32)
            p.keep.append(decay)
            p.decay = decay.data_ptr()
        elif planted == "factors_swapped":
            p.res_a1, p.res_b1, p.res_a2, p.res_b2 = p.res_b1, p.res_a1, p.res_b2, p.res_a2
        return p

    monkeypatch.setattr(mx, "block_plan", planted_plan)
    with pytest.raises(AssertionError):
        pd.check_greedy_generate(ref, fast, 2, 5, 6, monkeypatch)
