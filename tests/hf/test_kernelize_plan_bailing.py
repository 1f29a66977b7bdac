"""A kernelized Bailing hybrid made of KDA layers and dense MLPs decodes through the compiled whole-model plan
(hf/kernelize_plan_bailing.py: the KDA block kind with full-rank forget and output gates), against the UNPATCHED
model (transformers' PyTorch code), fp64 and fp32: greedy tokens identical and logits within 1e-5, batch > 1, the
lower-bounded ("safe") gate and the softplus one, transformers' cache objects holding transformers' values, a cache
copied or advanced by transformers' own code between compiled tokens, one compiled call per decoded token, the plan
rebuilt when a weight it copied is updated in place, bf16; MLA layers and MoE feed-forwards the plan does not compute
(a YaRN RoPE, router logits asked for) step aside (the whole model), through `generate`. Models with MLA layers and MoE
feed-forwards the plan computes: tests/hf/test_kernelize_plan_mla.py.

Such a model has no attention layer, so transformers' `generate` cannot run it (its cache reports no length): it
decodes token by token through the forward (tests/hf/plan_decode.py's `prefill` / `step`)."""
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "BailingHybridForCausalLM"):
    pytest.skip(f"the installed transformers ({transformers.__version__}) has no Bailing hybrid",
                allow_module_level=True)

from linattn.cpu import decode as cpu_decode  # noqa: E402
from linattn.hf.kernelize_plan_bailing import describe_model, undescribed_reason  # noqa: E402
from tests.hf import plan_decode as pd  # noqa: E402
from tests.hf.kernelize_models import V, transformers_torch_code  # noqa: E402, F401  (autouse)

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler: the compiled kernels are off")

KDA3 = ("linear_attention",) * 3


def _pair(dtype=torch.float32, tied=False, layers=KDA3, mlp=None, hooked=True, safe=True, **kw):
    """(unpatched, kernelized) Bailing hybrid (4 KDA heads of 16); the norms, A_log / dt_bias and the gated norm
    moved off their init values, q / k scaled up so that the L2 norms and the decays show."""
    cfg = transformers.BailingHybridConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=len(layers), num_attention_heads=4,
        num_key_value_heads=4, linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4, kv_lora_rank=16,
        q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8, moe_intermediate_size=16,
        num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
        kda_safe_gate=safe, layer_types=list(layers), mlp_layer_types=list(mlp or ["dense"] * len(layers)),
        tie_word_embeddings=tied, pad_token_id=0, bos_token_id=1, eos_token_id=2, **kw)
    return pd.perturbed_pair(transformers.BailingHybridForCausalLM, cfg, dtype, hooked,
                             moved=("norm", "A_log", "dt_bias"), scaled=("q_proj", "k_proj"))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("B,T,n,tied,safe", [(1, 1, 12, False, True), (3, 9, 30, False, False),
                                             (2, 5, 8, True, True)])
def test_greedy_decode_matches_the_unpatched_model(B, T, n, tied, safe, dtype, monkeypatch):
    """The lower-bounded gate and the softplus one."""
    ref, fast = _pair(dtype, tied=tied, safe=safe)
    assert inspect.signature(fast.forward) == inspect.signature(ref.forward)
    pd.check_forward_greedy(ref, fast, B, T, n, monkeypatch)


def test_cache_objects_hold_transformers_values(monkeypatch):
    pd.check_forward_cache_values(*_pair(), 3, monkeypatch)


def test_cache_copied_and_advanced_by_transformers_between_calls(monkeypatch):
    pd.check_forward_cache_copied_and_advanced(*_pair(), monkeypatch)


@pytest.mark.parametrize("name,copied", [
    ("model.layers.0.input_layernorm.weight", False), ("model.layers.1.self_attn.o_norm.weight", False),
    ("model.layers.2.self_attn.conv1d.weight", False), ("model.layers.1.self_attn.forget_gate.f_proj.weight", False),
    ("model.layers.0.self_attn.g_proj.weight", False), ("model.layers.2.self_attn.forget_gate.A_log", True),
    ("model.layers.1.mlp.up_proj.weight", False)])
def test_in_place_update_of_a_weight_is_read(name, copied, monkeypatch):
    """The plan copies -exp(A_log); the norms, the conv weights and the parts of the fused products (the first
    product with both full-rank gates, gate | up) are read in place."""
    pd.check_forward_in_place_update(*_pair(), name, copied, monkeypatch)


def test_bf16_decodes_through_the_plan(monkeypatch):
    pd.check_forward_bf16(*_pair(torch.bfloat16), monkeypatch)


@pytest.mark.parametrize("layers,mlp,kw,why", [
    (("linear_attention", "full_attention", "linear_attention"), None,
     {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                          "original_max_position_embeddings": 64}}, "default RoPE"),
    (KDA3, ("dense", "sparse", "dense"), {"output_router_logits": True}, "output_router_logits"),
])
def test_what_mla_and_moe_blocks_do_not_compute_step_aside(layers, mlp, kw, why, monkeypatch):
    """An MLA layer with a YaRN RoPE, or router logits asked for: not hooked, the reason given."""
    ref, fast = _pair(layers=layers, mlp=mlp, hooked=False, **kw)
    pd.check_not_described(ref, fast, undescribed_reason, why, describe_model, "full_attention" in layers,
                           monkeypatch)


def test_a_kda_only_model_is_described_with_full_rank_gates():
    _, fast = _pair()
    assert undescribed_reason(fast) is None
    desc, kdas = describe_model(fast)
    assert [b.kind for b in desc.blocks] == ["kda"] * 3 and len(kdas) == 3
    assert (kdas[0].W.out_features, kdas[0].W.in_features) == (3 * 64 + 4 + 64 + 64, 32)   # q|k|v|b|f|gate (full rank)
