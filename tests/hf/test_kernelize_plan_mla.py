"""Kimi Linear and the Bailing hybrid with their real layer patterns (KDA layers and MLA layers, dense first MLPs and
MoE feed-forwards with DeepSeek-V3's grouped router) decode through the compiled whole-model plan
(hf/kernelize_plan_kimi.py, hf/kernelize_plan_bailing.py: the latent-attention block kind 7, csrc/decode_mla.h —
Bailing's with its interleaved RoPE and head-wise gate — and the MoE router mode 2, csrc/decode_moe.h), each against
the UNPATCHED model (transformers' own `KimiLinearForCausalLM` / `BailingHybridForCausalLM`): greedy tokens identical
and logits within 1e-5 (fp32, fp64) through `generate`, q with and without its low-rank stage, batch > 1 with rows
taking different experts, sampling with a seed, left padding stepping aside, bf16, transformers' cache holding
transformers' values (the normed latents and the shared — for Bailing rotated — rope keys), transformers' own decode
and the plan handing the cache to each other, in-place weight updates; and the plan with its latent norm, correction
bias or scaling factor (Bailing: also its RoPE or gate) broken giving other logits. Every test runs once per
architecture (`arch`: "kimi", "bailing"); an architecture the installed transformers lacks skips its tests."""
import functools
from dataclasses import dataclass
from typing import Callable, Tuple

import pytest
import torch

transformers = pytest.importorskip("transformers")

from linattn.cpu import decode as cpu_decode  # noqa: E402
from linattn.hf import kernelize_plan_bailing, kernelize_plan_kimi  # noqa: E402
from tests.hf import plan_decode as pd  # noqa: E402
from tests.hf.kernelize_models import V, transformers_torch_code  # noqa: E402, F401  (autouse)

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler: the compiled kernels are off")

E = 8   # routed experts, in 4 groups


@dataclass(frozen=True)
class Arch:
    """One architecture's model and where its parts sit in the layer pattern."""
    model: str                 # the transformers class
    config: str
    described: object          # the kernelize_plan_<arch> module
    layers: Tuple[str, ...]    # layer_types
    config_kw: dict
    first_moe: int             # the first layer with an MoE block
    cache_row: Callable        # a cache tensor of an MLA layer, unchanged by decoding a copy of the cache
    weights: Tuple[str, ...]   # weights read in place (MLA's, the router's, the experts', the shared experts')
    broken: Tuple[tuple, ...] = ()   # the architecture's own plan fields that the comparisons would catch


def _check_kimi_parts(fast, desc, parts):
    assert [b.kind for b in desc.blocks] == ["kda", "kda", "mla", "kda"]
    assert [b.ffn for b in desc.blocks] == ["swiglu", "moe", "moe", "moe"]
    assert type(parts[2][0]).__name__ == "MLA" and parts[2][0].W.out_features == 2 * 24 + 16 + 8


def _check_bailing_parts(fast, desc, parts):
    assert [b.kind for b in desc.blocks] == ["kda", "kda", "mla"] * 2
    assert [b.ffn for b in desc.blocks] == ["swiglu"] * 3 + ["moe"] * 3
    assert type(parts[2]).__name__ == "MLA" and parts[2].W.out_features == 2 * 24 + 16 + 8 + 2   # q|kv_a|gate
    assert type(parts[5][0]).__name__ == "MLA" and parts[5][0].rotary is fast.model.rotary_emb


ARCHS = {
    # Kimi Linear's pattern (3 KDA : 1 MLA), the first layer dense and the others MoE, as the released checkpoints
    "kimi": Arch(
        "KimiLinearForCausalLM", "KimiLinearConfig", kernelize_plan_kimi,
        ("linear_attention", "linear_attention", "full_attention", "linear_attention"),
        dict(linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4, num_expert_group=4,
             num_shared_experts=1, mlp_layer_types=["dense", "sparse", "sparse", "sparse"]),
        1, lambda c: c.layers[2].keys,
        ("model.layers.2.self_attn.kv_a_layernorm.weight", "model.layers.2.self_attn.kv_b_proj.weight",
         "model.layers.2.self_attn.kv_a_proj_with_mqa.weight", "model.layers.2.self_attn.o_proj.weight",
         "model.layers.1.mlp.gate.weight", "model.layers.3.mlp.experts.gate_up_proj",
         "model.layers.2.mlp.shared_experts.down_proj.weight")),
    # Bailing's pattern (`layer_group_size` 3: two KDA layers then MLA), dense first layers (`first_k_dense_replace`),
    # as the released checkpoints: one MLA layer with a dense MLP, one with an MoE block
    "bailing": Arch(
        "BailingHybridForCausalLM", "BailingHybridConfig", kernelize_plan_bailing,
        ("linear_attention", "linear_attention", "full_attention") * 2,
        dict(head_dim=16, short_conv_kernel_size=4, layer_group_size=3, first_k_dense_replace=3, n_group=4,
             n_shared_experts=1, rope_theta=10000.0),
        3, lambda c: c.layers[5].values,
        ("model.layers.5.self_attn.kv_a_layernorm.weight", "model.layers.2.self_attn.kv_b_proj.weight",
         "model.layers.5.self_attn.g_proj.weight", "model.layers.2.self_attn.o_proj.weight",
         "model.layers.3.mlp.gate.weight", "model.layers.4.mlp.experts.down_proj",
         "model.layers.5.mlp.shared_experts.gate_proj.weight"),
        (("rot", 0),                                     # no RoPE
         ("mla_gate", 0))),                              # no head-wise gate
}
CHECK_PARTS = {"kimi": _check_kimi_parts, "bailing": _check_bailing_parts}


def _arch(name: str) -> Arch:
    a = ARCHS[name]
    if not hasattr(transformers, a.model):
        pytest.skip(f"the installed transformers ({transformers.__version__}) has no {a.model}")
    return a


def _config(a: Arch, q_lora=None, **kw):
    common = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=len(a.layers),
                  num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=q_lora,
                  qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, moe_intermediate_size=16,
                  num_local_experts=E, num_experts_per_tok=2, topk_group=2, routed_scaling_factor=2.5,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if a.model.startswith("Kimi"):
        common["layer_types"] = list(a.layers)
    return getattr(transformers, a.config)(**{**common, **a.config_kw, **kw})


def _pair(arch: str, dtype=torch.float32, q_lora=None, **kw):
    """(unpatched, kernelized): norms, A_log / dt_bias and the routers moved off their init values (router logits of
    order 1), q / k / the latent scaled up, correction biases of order 0.3 (they change the choice)."""
    a = _arch(arch)
    ref, fast = pd.perturbed_pair(getattr(transformers, a.model), _config(a, q_lora, **kw), dtype,
                                  moved=("norm", "A_log", "dt_bias", "mlp.gate."),
                                  scaled=("q_proj", "k_proj", "q_a_proj", "q_b_proj", "kv_a_proj", "mlp.gate."))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for x, y in zip(ref.model.layers, fast.model.layers):
            if "gate" in x.mlp._modules:
                bias = 0.3 * torch.randn(E, generator=g)
                x.mlp.gate.e_score_correction_bias.copy_(bias)
                y.mlp.gate.e_score_correction_bias.copy_(bias)
    return ref, fast


every_arch = pytest.mark.parametrize("arch", sorted(ARCHS))


class TestGenerate(pd.GenerateChecks):
    @pytest.fixture(params=sorted(ARCHS))
    def pair(self, request):
        return functools.partial(_pair, request.param)

    #: KDA then MLA, dense MLPs (Kimi's keyword, then Bailing's)
    COMPILE_PAIR = dict(num_hidden_layers=3, layer_types=["linear_attention", "linear_attention", "full_attention"],
                        mlp_layer_types=["dense"] * 3, first_k_dense_replace=3)

    def described_module(self, fast):
        return fast.model.layers[2].self_attn.kv_b_proj   # (an MLA layer's, in both patterns)


@every_arch
def test_the_real_layer_pattern_is_described(arch):
    _, fast = _pair(arch)
    described = ARCHS[arch].described
    assert described.undescribed_reason(fast) is None
    desc, parts = described.describe_model(fast)
    CHECK_PARTS[arch](fast, desc, parts)


@pytest.mark.parametrize("B,T,n,q_lora", [(1, 1, 10, None), (3, 7, 16, None), (2, 5, 12, 12)])
@every_arch
def test_greedy_generate_matches_the_unpatched_model(arch, B, T, n, q_lora, monkeypatch):
    """Batch 3: the rows of a decoded token take different experts (seen on the unpatched model's routers)."""
    ref, fast = _pair(arch, q_lora=q_lora)
    routes = []
    for layer in ref.model.layers[ARCHS[arch].first_moe:]:
        layer.mlp.gate.register_forward_hook(lambda m, a, out: routes.append(out[2].clone()))
    pd.check_greedy_generate(ref, fast, B, T, n, monkeypatch)
    if B > 1:
        one_token = [r for r in routes if r.shape[0] == B]
        assert one_token and any(len({tuple(sorted(row.tolist())) for row in r}) > 1 for r in one_token)


@pytest.mark.parametrize("q_lora", [None, 12])
@every_arch
def test_fp64_logits_within_1e_5(arch, q_lora, monkeypatch):
    """(transformers' default experts kernel, torch._grouped_mm, takes no fp64: its eager loop then)"""
    pd.check_greedy_generate(*_pair(arch, torch.float64, q_lora, experts_implementation="eager"), 2, 5, 12,
                             monkeypatch)


@every_arch
def test_cache_objects_hold_transformers_values(arch, monkeypatch):
    """The MLA layer's keys / values (normed latents, shared rope keys) and the KDA states as transformers' own
    decode leaves them."""
    pd.check_cache_values(*_pair(arch), monkeypatch)


@every_arch
def test_bf16_with_fp32_routers(arch, monkeypatch):
    """As transformers loads a bf16 checkpoint (`_keep_in_fp32_modules_strict`): the routers' weights and
    correction biases stay fp32, read by the plan as they are."""
    ref, fast = _pair(arch, torch.bfloat16)
    for m in (ref, fast):
        for layer in m.model.layers[ARCHS[arch].first_moe:]:
            layer.mlp.gate.float()
    pd.check_bf16(ref, fast, torch.bfloat16, monkeypatch)


@every_arch
def test_cache_handed_between_the_plan_and_transformers(arch, monkeypatch):
    """Tokens decoded by transformers' own code between compiled ones, a copied cache decoded on its own (the
    original MLA layer's latents unchanged), a generate continued on a returned cache."""
    pd.check_cache_copied_and_advanced(*_pair(arch), ARCHS[arch].cache_row, monkeypatch)


@pytest.mark.parametrize("arch,name", [(arch, name) for arch in sorted(ARCHS) for name in ARCHS[arch].weights])
def test_in_place_update_of_a_weight_is_read(arch, name, monkeypatch):
    """The MLA layer's and the MoE block's weights are read in place: an update between tokens needs no rebuild
    and the next token reads it."""
    pd.check_in_place_update(*_pair(arch), name, False, monkeypatch)


@every_arch
def test_in_place_update_of_the_correction_bias(arch, monkeypatch):
    """The correction bias (a buffer) read in place: updated between tokens, the plan stays valid and the next
    token's choice reads it."""
    mla = ARCHS[arch].layers.index("full_attention", ARCHS[arch].first_moe)   # an MLA layer with an MoE block

    def change(m):
        m.model.layers[mla].mlp.gate.e_score_correction_bias[:4] += 5.0

    pd.check_changed_between_tokens(*_pair(arch), change, False, monkeypatch)


def _breaking(plan_field, value):
    """A `check_broken_plan` change: `plan_field` of every MLA (or MoE-mode-2) block plan set to value (or to
    `value(p)`)."""
    def breaks(block_plans, model_plan):
        for p in block_plans:
            if p.kind == 7 or p.router == 2:
                if hasattr(p, plan_field) and (plan_field != "mla_kvnw" or p.kind == 7):
                    setattr(p, plan_field, value(p) if callable(value) else value)
    return breaks


BROKEN = (("mla_kvnw", None),                        # the latent's RMSNorm without its weight
          ("routed_scale", 1.0),                     # no routed scaling factor
          ("router", 0))                             # Qwen's softmax router instead of the sigmoid grouped one


@pytest.mark.parametrize("arch,field,value", [(arch, *fv) for arch in sorted(ARCHS)
                                              for fv in BROKEN + ARCHS[arch].broken])
def test_a_broken_plan_gives_other_logits(arch, field, value):
    """What the comparisons above check is what these parts compute: with one of them broken in the plan, the
    logits leave the unpatched model's."""
    pd.check_broken_plan(*_pair(arch), _breaking(field, value))


@every_arch
def test_the_correction_bias_decides_the_choice(arch):
    """The correction bias zeroed in the plan: other experts are chosen, other logits."""
    keep = []

    def zero_bias(p):
        z = torch.zeros(p.n_experts)
        keep.append(z)
        return z.data_ptr()
    pd.check_broken_plan(*_pair(arch), _breaking("e_bias", zero_bias))
