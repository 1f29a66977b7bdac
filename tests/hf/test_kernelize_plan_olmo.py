"""A kernelized OLMo-hybrid decodes through the compiled whole-model plan (hf/kernelize_plan_olmo.py): its Gated
DeltaNet blocks (pre-norm, beta = 2 sigmoid with negative eigenvalues allowed) and its post-norm softmax-attention
blocks (q / k RMSNorms over the whole projections, RoPE or NoPE). Through transformers' `generate`, against the
UNPATCHED model (transformers' PyTorch code), fp64 and fp32: greedy tokens identical and logits within 1e-5,
sampled tokens with a seed, batch > 1, beam search, transformers' cache objects holding transformers' values, a
cache copied, continued or advanced by transformers' own code between compiled tokens (the handoff both ways), left
padding (the plan steps aside), one compiled call per decoded token, the plan rebuilt when a weight it copied is
updated in place, bf16, and what the plan does not compute stepping aside."""
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "OlmoHybridForCausalLM"):
    pytest.skip(f"the installed transformers ({transformers.__version__}) has no OLMo-hybrid", allow_module_level=True)

from linattn.cpu import decode as cpu_decode  # noqa: E402
from linattn.hf.kernelize_plan_olmo import describe_model, undescribed_reason  # noqa: E402
from tests.hf import plan_decode as pd  # noqa: E402
from tests.hf.kernelize_models import (  # noqa: E402
    ATTN,
    GDN,
    transformers_torch_code,  # noqa: F401  (autouse)
)

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler: the compiled kernels are off")

#: RoPE as OLMo-hybrid's config spells it; rope_theta None: no rotary embedding (NoPE, the released checkpoints)
ROPE = {"rope_type": "default", "rope_theta": 10000.0}
NOPE = {"rope_type": "default", "rope_theta": None}


def _pair(dtype=torch.float32, tied=False, hooked=True, rope=ROPE, neg=True,
          layers=("linear_attention", "full_attention", "linear_attention", "full_attention"), **cfg):
    """(unpatched, kernelized) OLMo-hybrid of 4 layers, 2 of them post-norm softmax attention; the norms (block,
    q / k, gated output), A_log / dt_bias moved off their init values, q / k scaled up so that the whole-projection
    norms, the softmax and RoPE show."""
    cfg = transformers.OlmoHybridConfig(**{k: v for k, v in ATTN.items() if k != "head_dim"}, **GDN,
                                        num_hidden_layers=len(layers), layer_types=list(layers),
                                        tie_word_embeddings=tied, rope_parameters=dict(rope),
                                        linear_allow_neg_eigval=neg, **cfg)
    return pd.perturbed_pair(transformers.OlmoHybridForCausalLM, cfg, dtype, hooked,
                             moved=("norm", "A_log", "dt_bias"), scaled=("q_proj", "k_proj"))


class TestGenerate(pd.GenerateChecks):
    make_pair = staticmethod(_pair)
    COMPILE_PAIR = dict(layers=("linear_attention", "full_attention"))

    def described_module(self, fast):
        return fast.model.layers[1].post_feedforward_layernorm


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("B,T,n,tied", [(1, 1, 12, False), (3, 9, 70, False), (2, 5, 8, True)])
def test_greedy_generate_matches_the_unpatched_model(B, T, n, tied, dtype, monkeypatch):
    """70 tokens grow the KV buffers past their chunk."""
    ref, fast = _pair(dtype, tied=tied)
    assert inspect.signature(fast.forward) == inspect.signature(ref.forward)
    pd.check_greedy_generate(ref, fast, B, T, n, monkeypatch)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("rope,neg", [(NOPE, True), (ROPE, False), (NOPE, False)])
def test_nope_and_beta_without_negative_eigenvalues(rope, neg, dtype, monkeypatch):
    """Without a rotary embedding (NoPE) and with beta = sigmoid (linear_allow_neg_eigval=False)."""
    ref, fast = _pair(dtype, rope=rope, neg=neg)
    assert (fast.model.rotary_emb is None) is (rope is NOPE)
    pd.check_greedy_generate(ref, fast, 2, 6, 10, monkeypatch)


@pytest.mark.parametrize("layers", [("full_attention", "linear_attention", "full_attention"),
                                    ("linear_attention", "linear_attention", "full_attention")])
def test_other_layer_orders(layers, monkeypatch):
    """A post-norm attention block first (the embedding straight into it), two GDN blocks in a row."""
    pd.check_greedy_generate(*_pair(layers=layers), 2, 4, 8, monkeypatch)


def test_the_blocks_are_described_in_their_residual_orders():
    """GDN blocks pre-norm (input_layernorm, post_attention_layernorm), attention blocks post-norm
    (post_attention_layernorm, post_feedforward_layernorm) with whole-projection q / k norms."""
    _, fast = _pair()
    desc, parts = describe_model(fast)
    layers = fast.model.layers
    for i, (bd, part) in enumerate(zip(desc.blocks, parts)):
        if i % 2 == 0:
            assert (bd.kind, bd.residual) == ("delta", "prenorm") and part.beta_mode == "doubled"
            assert bd.norm1.weight is layers[i].input_layernorm.weight
            assert bd.norm2.weight is layers[i].post_attention_layernorm.weight
        else:
            assert (bd.kind, bd.residual, part) == ("softmax", "postnorm", None)
            assert bd.norm1.weight is layers[i].post_attention_layernorm.weight
            assert bd.norm2.weight is layers[i].post_feedforward_layernorm.weight
            assert bd.attention.norm_whole and bd.attention.rot == bd.attention.head_dim


def test_cache_objects_hold_transformers_values(monkeypatch):
    """After compiled tokens the cache holds what transformers' own decode leaves: recurrent and conv states, keys
    and values, the sequence length (fp64: transformers' own GDN code keeps its recurrent states in fp32, the
    kernelized model in the model's dtype)."""
    pd.check_cache_values(*_pair(torch.float64), monkeypatch, state_dtype=False)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cache_copied_continued_and_advanced_by_transformers_between_calls(dtype, monkeypatch):
    """The handoff both ways: transformers' own tokens (the kernels switched off) between compiled ones, a copied
    cache, a generate continued on a returned cache."""
    pd.check_cache_copied_and_advanced(*_pair(dtype), lambda c: c.layers[1].keys, monkeypatch)


@pytest.mark.parametrize("name,copied", [
    ("model.layers.0.input_layernorm.weight", False), ("model.layers.1.post_attention_layernorm.weight", False),
    ("model.layers.1.post_feedforward_layernorm.weight", False), ("model.layers.1.self_attn.q_norm.weight", False),
    ("model.layers.3.self_attn.k_proj.weight", False), ("model.norm.weight", False),
    ("model.layers.0.linear_attn.g_proj.weight", False), ("model.layers.2.linear_attn.A_log", True),
    ("model.layers.1.mlp.up_proj.weight", False)])
def test_in_place_update_of_a_weight_is_read(name, copied, monkeypatch):
    """A weight updated in place between tokens: the next token reads the new value (-exp(A_log) is a copy: the
    plan rebuilds; the norms, the attention matrices and the parts of the fused GDN projection and of gate | up are
    read in place)."""
    pd.check_in_place_update(*_pair(), name, copied, monkeypatch)


def test_attention_biases_step_aside():
    """attention_bias=True (biases on q / k / v / o): not described (the reason is given), not hooked, and the
    kernelized model decodes as the unpatched one."""
    ref, fast = _pair(hooked=False, attention_bias=True)
    assert "bias" in undescribed_reason(fast) and "forward" not in fast.__dict__
    prompt = pd.prompt(2, 4)
    got, want = pd.generate(fast, prompt, 4), pd.generate(ref, prompt, 4)
    assert torch.equal(got.sequences, want.sequences)
