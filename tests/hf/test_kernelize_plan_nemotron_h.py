"""A kernelized Nemotron-H (`NemotronHForCausalLM`) decodes through the compiled whole-model plan
(hf/kernelize_plan_nemotron_h.py): every block ONE of a Mamba2 mixer (n_groups > 1), softmax attention (no RoPE),
a non-gated relu^2 MLP or a mixture of relu^2 experts behind DeepSeek-V3's grouped sigmoid router, each behind one
norm. Through transformers' `generate`, against the UNPATCHED model (transformers' PyTorch code), fp64 and fp32:
greedy tokens identical and logits within 1e-5, sampling with a seed, batch > 1 with rows on different experts,
transformers' cache holding transformers' values (no entry for the MLP and MoE blocks), the handoff both ways, left
padding stepping aside, in-place updates read, bf16, torch.compile stepping aside, what the plan does not compute
stepping aside, and a broken router in the plan changing the logits."""
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "NemotronHForCausalLM"):
    pytest.skip(f"the installed transformers ({transformers.__version__}) has no Nemotron-H", allow_module_level=True)

from linattn.cpu import decode as cpu_decode  # noqa: E402
from linattn.hf import kernelize_plan as plan  # noqa: E402
from linattn.hf.kernelize_plan_nemotron_h import describe_model, undescribed_reason  # noqa: E402
from tests.helpers import CompiledDecodeCalls  # noqa: E402
from tests.hf import plan_decode as pd  # noqa: E402
from tests.hf.kernelize_models import (  # noqa: E402
    ATTN,
    transformers_torch_code,  # noqa: F401  (autouse)
)

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler: the compiled kernels are off")

#: the released models' pattern in small (Nemotron-3-Nano's "MEMEM*EMEMEM*..."; Nemotron-H's "M-M-M*-M-...")
PATTERN = "MEM*-EM-"
E = 8
_TYPES = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}


def _pair(dtype=torch.float32, pattern=PATTERN, hooked=True, **cfg):
    """(unpatched, kernelized) Nemotron-H of the block pattern `pattern` (M Mamba2, E MoE, * attention, - MLP):
    2 groups of B / C, 8 experts in 4 groups of which 2 are kept, routed scaling 2.5; the norms, A_log / dt_bias /
    D, the conv bias and the routers moved off their init values, q / k and the Mamba2 input projections scaled
    up, correction biases of order 0.3 (they change the choice)."""
    cfg = transformers.NemotronHConfig(**{
        **ATTN, **dict(intermediate_size=48, layers_block_type=[_TYPES[c] for c in pattern], ssm_state_size=8,
                       mamba_num_heads=4, mamba_head_dim=16, n_groups=2, conv_kernel=4, expand=2, chunk_size=8,
                       n_routed_experts=E, num_experts_per_tok=2, moe_intermediate_size=16,
                       moe_shared_expert_intermediate_size=24, n_group=4, topk_group=2, routed_scaling_factor=2.5),
        **cfg})
    ref, fast = pd.perturbed_pair(transformers.NemotronHForCausalLM, cfg, dtype, hooked,
                                  moved=("norm", "A_log", "dt_bias", ".D", "conv1d.bias", "gate.weight"),
                                  scaled=("q_proj", "k_proj", "in_proj", "gate.weight"))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for a, b in zip(ref.model.layers, fast.model.layers):
            if a.block_type == "moe":
                bias = 0.3 * torch.randn(E, generator=g)
                a.mixer.gate.e_score_correction_bias.copy_(bias)
                b.mixer.gate.e_score_correction_bias.copy_(bias)
    for m in (ref, fast):
        if hasattr(m, "set_experts_implementation"):
            m.set_experts_implementation("eager")   # (torch._grouped_mm takes no fp64)
    return ref, fast


class TestGenerate(pd.GenerateChecks):
    make_pair = staticmethod(_pair)
    COMPILE_PAIR = dict(pattern="M*-")   # Mamba2, attention, MLP
    BF16_LOGITS = torch.float32   # (as transformers returns them)

    def described_module(self, fast):
        return fast.model.layers[4].mixer.down_proj

    def test_the_hook_returns_the_unpatched_forwards_output_class(self, pair, monkeypatch):
        got, _ = pd.check_output_class(*pair(), monkeypatch)
        assert got.logits.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("B,T,n", [(1, 1, 12), (3, 9, 70), (2, 5, 8)])
def test_greedy_generate_matches_the_unpatched_model(B, T, n, dtype, monkeypatch):
    """70 tokens grow the KV buffers past their chunk; batch 3: the rows of a decoded token take different experts
    (seen on the unpatched model's routers)."""
    ref, fast = _pair(dtype)
    assert type(fast).__name__ in plan._ARCHITECTURES
    assert inspect.signature(fast.forward) == inspect.signature(ref.forward)
    routes = []
    for layer in ref.model.layers:
        if layer.block_type == "moe":
            layer.mixer.gate.register_forward_hook(lambda m, a, out: routes.append(out[2].clone()))
    pd.check_greedy_generate(ref, fast, B, T, n, monkeypatch)
    if B > 1:
        one_token = [r for r in routes if r.shape[0] == B]
        assert one_token and any(len({tuple(sorted(row.tolist())) for row in r}) > 1 for r in one_token)


@pytest.mark.parametrize("pattern", ["*M-M", "M-*", "-*EM", "E*M", "M*MM*"])
def test_other_layer_patterns(pattern, monkeypatch):
    """An attention block or an MLP / MoE block first (the embedding straight into it), blocks of one type in a row,
    a model without MoE or without MLP blocks (each with a Mamba2 block: kernelize serves a model through its
    linear-attention layers)."""
    pd.check_greedy_generate(*_pair(pattern=pattern), 2, 4, 8, monkeypatch)


def test_the_blocks_are_described_as_they_are(monkeypatch):
    """Mamba2 (kind 5, no FFN), attention (kind 2, no RoPE, no FFN), MLP blocks and MoE blocks without a mixer
    (`ffn_only`, their one norm before the FFN), relu^2 (`ffn_act` 1) with the up rows only, router mode 2 with the
    model's groups and scaling."""
    ref, fast = _pair()
    desc, parts = describe_model(fast)
    layers = fast.model.layers
    assert [b.kind for b in desc.blocks] == ["mamba2", "ffn_only", "mamba2", "softmax", "ffn_only", "ffn_only",
                                             "mamba2", "ffn_only"]
    assert [b.ffn for b in desc.blocks] == [None, "moe", None, None, "relu2", "moe", None, "relu2"]
    for i, bd in enumerate(desc.blocks):
        assert bd.norm1.weight is layers[i].norm.weight
        if bd.ffn == "relu2":
            assert bd.norm2.weight is layers[i].norm.weight and bd.ffn_gate_up is layers[i].mixer.up_proj
    assert desc.blocks[3].attention.rot == 0
    pd.check_greedy_generate(ref, fast, 1, 3, 2, monkeypatch)
    plans = fast._linattn_model_plan.keep[0]
    assert [(p.ffn_only, p.has_ffn, p.ffn_act, p.ffn_kind) for p in plans] == [
        (0, 0, 0, 0), (1, 1, 1, 1), (0, 0, 0, 0), (0, 0, 0, 0), (1, 1, 1, 0), (1, 1, 1, 1), (0, 0, 0, 0), (1, 1, 1, 0)]
    moe = plans[1]
    assert (moe.router, moe.n_experts, moe.moe_hid, moe.hid, moe.moe_groups, moe.moe_topk_groups) == (2, E, 16, 24, 4,
                                                                                                      2)
    assert moe.routed_scale == 2.5 and moe.norm_topk == 1


def test_cache_objects_hold_transformers_values(monkeypatch):
    """The Mamba2 states and conv states, the keys and values; the MLP and MoE blocks' entries stay transformers'
    `DummyLayer`s. (fp64: transformers' own Mamba2 step leaves fp32 states in an fp64 model.)"""
    ref, fast = _pair(torch.float64)
    ids = pd.prompt(2, 6)
    calls = CompiledDecodeCalls(monkeypatch)
    got, want = (pd.generate(m, ids, 5).past_key_values for m in (fast, ref))
    assert calls.model == 4
    assert got.get_seq_length() == want.get_seq_length() == 10
    for c, lg, lw in zip(PATTERN, got.layers, want.layers):
        assert type(lg) is type(lw)
        if c == "M":
            torch.testing.assert_close(lg.recurrent_states[0], lw.recurrent_states[0], rtol=1e-5, atol=1e-6,
                                       check_dtype=False)
            torch.testing.assert_close(lg.conv_states[0], lw.conv_states[0], rtol=1e-5, atol=1e-6)
        elif c == "*":
            torch.testing.assert_close(lg.keys, lw.keys, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(lg.values, lw.values, rtol=1e-5, atol=1e-6)
        else:
            assert type(lg).__name__ == "DummyLayer" and lg.keys is None


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("watched", ["keys", "state"])
def test_cache_copied_continued_and_advanced_by_transformers_between_calls(dtype, watched, monkeypatch):
    """The handoff both ways: transformers' own tokens (the kernels switched off) between compiled ones, a copied
    cache (its keys and Mamba2 states untouched by the copy's tokens), a generate continued on a returned cache."""
    look = (lambda c: c.layers[3].keys) if watched == "keys" else (lambda c: c.layers[2].recurrent_states[0])
    pd.check_cache_copied_and_advanced(*_pair(dtype), look, monkeypatch)


@pytest.mark.parametrize("name,copied", [
    ("model.layers.0.norm.weight", False), ("model.layers.0.mixer.A_log", True),
    ("model.layers.2.mixer.in_proj.weight", False), ("model.layers.3.mixer.k_proj.weight", False),
    ("model.layers.4.mixer.up_proj.weight", False), ("model.layers.4.norm.weight", False),
    ("model.layers.1.mixer.gate.weight", False), ("model.layers.5.mixer.experts.up_proj", False),
    ("model.layers.5.mixer.shared_experts.down_proj.weight", False), ("model.norm_f.weight", False)])
def test_in_place_update_of_a_weight_is_read(name, copied, monkeypatch):
    """A weight updated in place between tokens: the next token reads the new value (-exp(A_log) is a copy: the
    plan rebuilds; the rest is read in place)."""
    pd.check_in_place_update(*_pair(), name, copied, monkeypatch)


@pytest.mark.parametrize("cfg,why", [(dict(mlp_bias=True), "bias"), (dict(moe_latent_size=16), "latent"),
                                     (dict(mlp_hidden_act="relu"), "relu2"),
                                     (dict(output_router_logits=True), "router logits")])
def test_what_the_plan_does_not_compute_steps_aside(cfg, why, monkeypatch):
    """MLP biases, the MoE's latent projections, another activation, router logits asked for: not described (the
    reason given), not hooked, and the kernelized model decodes as the unpatched one."""
    ref, fast = _pair(hooked=False, **cfg)
    pd.check_not_described(ref, fast, undescribed_reason, why, describe_model,
                           not cfg.get("output_router_logits"), monkeypatch)


@pytest.mark.parametrize("field,value,blocks", [
    ("routed_scale", 1.0, "moe"),     # no routed scaling factor
    ("router", 0, "moe"),             # a softmax router instead of the grouped sigmoid one
    ("norm_topk", 0, "moe"),          # the chosen scores not renormalised
    ("n2w", None, "mlp"),             # the MLP block's norm without its weight
])
def test_a_broken_plan_changes_the_logits(field, value, blocks):
    """What the comparisons above check is what these parts compute: with one of them broken in the plan's MoE (or
    MLP) blocks, the logits leave the unpatched model's."""
    def breaks(block_plans, model_plan):
        for p in block_plans:
            if (p.router == 2) if blocks == "moe" else (p.ffn_only and p.ffn_kind == 0):
                setattr(p, field, value)

    pd.check_broken_plan(*_pair(), breaks)
