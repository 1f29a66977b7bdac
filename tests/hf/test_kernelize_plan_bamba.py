"""A kernelized Bamba decodes through the compiled whole-model plan (hf/kernelize_plan_bamba.py): its Mamba2 blocks
and its softmax-attention blocks (partial RoPE), each with a SwiGLU MLP. Through transformers' `generate`, against
the UNPATCHED model (transformers' PyTorch code), fp64 and fp32: greedy tokens identical and logits within 1e-5,
sampled tokens with a seed, batch > 1, beam search, transformers' cache objects holding transformers' values, a
cache copied, continued or advanced by transformers' own code between compiled tokens (the handoff both ways), left
padding (the plan steps aside), one compiled call per decoded token, the plan rebuilt when a weight it copied is
updated in place, bf16, and what the plan does not compute stepping aside."""
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "BambaForCausalLM"):
    pytest.skip(f"the installed transformers ({transformers.__version__}) has no Bamba", allow_module_level=True)

from linattn.cpu import decode as cpu_decode  # noqa: E402
from linattn.hf import kernelize_plan as plan  # noqa: E402
from linattn.hf.kernelize_plan_bamba import describe_model, undescribed_reason  # noqa: E402
from tests.helpers import CompiledDecodeCalls  # noqa: E402
from tests.hf import plan_decode as pd  # noqa: E402
from tests.hf.kernelize_models import (  # noqa: E402
    ATTN,
    MAMBA_H,
    transformers_torch_code,  # noqa: F401  (autouse)
)

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler: the compiled kernels are off")


def _pair(dtype=torch.float32, tied=False, hooked=True, layers=5, attn=(1, 4), **cfg):
    """(unpatched, kernelized) Bamba of `layers` blocks, softmax attention at `attn` (Bamba-9B's pattern: Mamba2
    blocks with an attention block every few), 2 groups of B / C; the norms, A_log / dt_bias / D and the conv bias
    moved off their init values, the Mamba2 input projections and q / k scaled up so that the scan, the softmax
    and RoPE show."""
    cfg = transformers.BambaConfig(**{k: v for k, v in ATTN.items() if k != "head_dim"}, **MAMBA_H,
                                   num_hidden_layers=layers, attn_layer_indices=list(attn),
                                   tie_word_embeddings=tied, **cfg)
    return pd.perturbed_pair(transformers.BambaForCausalLM, cfg, dtype, hooked,
                             moved=("norm", "A_log", "dt_bias", ".D", "conv1d.bias"),
                             scaled=("q_proj", "k_proj", "in_proj"))


class TestGenerate(pd.GenerateChecks):
    make_pair = staticmethod(_pair)
    COMPILE_PAIR = dict(layers=2, attn=(1,))   # a Mamba2 block, a softmax block
    POSITIONS = True   # (Bamba's forward rotates a token given no position ids as if at position 0)

    def described_module(self, fast):
        return fast.model.layers[2].mamba.out_proj


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("B,T,n,tied", [(1, 1, 12, False), (3, 9, 70, False), (2, 5, 8, True)])
def test_greedy_generate_matches_the_unpatched_model(B, T, n, tied, dtype, monkeypatch):
    """70 tokens grow the KV buffers past their chunk."""
    ref, fast = _pair(dtype, tied=tied)
    assert type(fast).__name__ in plan._ARCHITECTURES
    assert inspect.signature(fast.forward) == inspect.signature(ref.forward)
    pd.check_greedy_generate(ref, fast, B, T, n, monkeypatch)


@pytest.mark.parametrize("layers,attn", [(3, (0,)), (3, (2,)), (4, (2, 3))])
def test_other_layer_orders(layers, attn, monkeypatch):
    """An attention block first (the embedding straight into it), last, two in a row (a Bamba without attention
    blocks cannot run transformers' generate: its cache reports no length)."""
    pd.check_greedy_generate(*_pair(layers=layers, attn=attn), 2, 4, 8, monkeypatch)


def test_the_blocks_are_described_as_they_are():
    """Mamba2 blocks (the mixer as the part, kind 5 with the block's MLP), attention blocks (partial RoPE over half
    a head, no q / k norm, no gate)."""
    _, fast = _pair()
    desc, parts = describe_model(fast)
    layers = fast.model.layers
    for i, (bd, part) in enumerate(zip(desc.blocks, parts)):
        assert bd.norm1.weight is layers[i].input_layernorm.weight
        assert bd.norm2.weight is layers[i].pre_ff_layernorm.weight
        assert bd.ffn_down is layers[i].feed_forward.down_proj
        if i in (1, 4):
            assert (bd.kind, part) == ("softmax", None)
            att = bd.attention
            assert att.rot == att.head_dim // 2 and att.q_norm is None and att.gate is None
        else:
            assert bd.kind == "mamba2" and part is layers[i].mamba


def test_cache_objects_hold_transformers_values(monkeypatch):
    """(fp64: transformers' own Mamba2 scan leaves fp32 states in an fp64 model, the kernelized model fp64 ones.)"""
    pd.check_cache_values(*_pair(torch.float64), monkeypatch, state_dtype=False)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("watched", ["keys", "state"])
def test_cache_copied_continued_and_advanced_by_transformers_between_calls(dtype, watched, monkeypatch):
    """The handoff both ways: transformers' own tokens (the kernels switched off) between compiled ones, a copied
    cache (its keys and Mamba2 states untouched by the copy's tokens), a generate continued on a returned cache."""
    look = (lambda c: c.layers[1].keys) if watched == "keys" else (lambda c: c.layers[2].recurrent_states[0])
    pd.check_cache_copied_and_advanced(*_pair(dtype), look, monkeypatch, positions=True)


def test_a_call_without_position_ids_steps_aside(monkeypatch):
    """Bamba's forward rotates a token given no position ids as if at position 0: such a call runs transformers'
    forward (the same logits, no compiled call), one with them the plan."""
    ref, fast = _pair()
    ids = pd.prompt(2, 5)
    calls = CompiledDecodeCalls(monkeypatch)
    with torch.no_grad():
        caches = [m(ids, use_cache=True).cache for m in (fast, ref)]
        lg = [m(ids[:, -1:], cache=c).logits for m, c in zip((fast, ref), caches)]
        assert calls.model == 0 and pd.close(lg[0], lg[1])
        pos = torch.full((1, 1), 6)
        lg = [m(ids[:, -1:], cache=c, position_ids=pos).logits for m, c in zip((fast, ref), caches)]
    assert calls.model == 1 and pd.close(lg[0], lg[1])


@pytest.mark.parametrize("name,copied", [
    ("model.layers.0.input_layernorm.weight", False), ("model.layers.1.pre_ff_layernorm.weight", False),
    ("model.layers.1.self_attn.k_proj.weight", False), ("model.layers.0.mamba.A_log", True),
    ("model.layers.2.mamba.in_proj.weight", False), ("model.layers.2.mamba.D", False),
    ("model.layers.3.mamba.norm.weight", False), ("model.layers.4.feed_forward.up_proj.weight", False),
    ("model.final_layernorm.weight", False)])
def test_in_place_update_of_a_weight_is_read(name, copied, monkeypatch):
    """A weight updated in place between tokens: the next token reads the new value (-exp(A_log) is a copy: the
    plan rebuilds; the rest is read in place)."""
    pd.check_in_place_update(*_pair(), name, copied, monkeypatch, positions=True)


@pytest.mark.parametrize("cfg,why", [(dict(attention_bias=True), "bias"), (dict(mlp_bias=True), "bias"),
                                     (dict(mamba_proj_bias=True, time_step_limit=(0.0, 0.5)), "time_step_limit")])
def test_what_the_plan_does_not_compute_steps_aside(cfg, why, monkeypatch):
    """Attention or MLP biases, a clamped time step: not described (the reason given), not hooked, and the
    kernelized model decodes as the unpatched one."""
    ref, fast = _pair(hooked=False, **cfg)
    pd.check_not_described(ref, fast, undescribed_reason, why, describe_model, True, monkeypatch)
