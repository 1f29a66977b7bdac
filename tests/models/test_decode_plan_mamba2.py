"""Mamba2 blocks in the compiled decode (csrc/decode_mamba2.h, block kind 5): a model mixing Mamba2's mixer with
Gated DeltaNet and softmax layers decodes in ONE compiled call per token, within 4x the per-block PyTorch path's
own error of that path in fp64, in fp32 / fp64 / bf16 and int8 / int4 weights, for the mixer's options (groups of
B / C, D per channel, the norm before the gate or none, no convolution, biases, dt's clamp); its caches (the
`LinearAttentionState` and the "conv" window) continue on every other path and back; the guard sees its options."""
import pytest
import torch

from linattn.cpu import decode as cpu_decode
from linattn.quant import quantize, quantized_modules
from tests.helpers import CompiledDecodeCalls
from tests.models import decode_kinds as dk

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler: the compiled kernels are off")

CASES = {
    "defaults": dict(state_size=16),
    "groups, D per channel, norm before gate, biases, dt clamp": dict(
        state_size=16, n_groups=2, d_per_channel=True, norm_before_gate=True, proj_bias=True, dt_limit=(0.01, 0.05)),
    "no conv, no norm": dict(state_size=8, short_conv=False, gated_norm=False),
    "conv without bias, head_dim 8": dict(state_size=16, conv_bias=False, head_dim=8, conv_size=3),
}


def _model(dtype=torch.float32, **kw):
    return dk.hybrid("mamba2", dtype, kw)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("B,prefill", [(1, 1), (3, 5)])
def test_hybrid_with_mamba2_decodes_in_one_compiled_call(case, dtype, B, prefill, monkeypatch):
    model = _model(dtype, **CASES[case])
    if case.startswith("groups"):
        assert model.blocks[0].mixer.in_proj.bias is not None and model.blocks[0].mixer.o_proj.bias is not None
    dk.check_one_call_per_token(model, dtype, B, prefill, monkeypatch, layers=(0, 2))


@pytest.mark.parametrize("case", ["defaults", "groups, D per channel, norm before gate, biases, dt clamp"])
def test_handoff_between_the_whole_model_plan_the_block_plans_and_pytorch(case, monkeypatch):
    dk.check_handoff(_model(**CASES[case]), monkeypatch, kind_layers=(0, 2))


def test_block_plans_alone_match_the_pytorch_path(monkeypatch):
    dk.check_block_plans_alone(_model(**CASES["groups, D per channel, norm before gate, biases, dt clamp"]),
                               monkeypatch)


def _dt_limit(model):
    model.blocks[0].mixer.dt_limit = (0.0, 0.01)


def _d_per_channel(model):
    m = model.blocks[2].mixer
    m.D = torch.nn.Parameter(m.D.detach().repeat_interleave(m.head_dim))
    m.d_per_channel = True


def _norm_order(model):
    model.blocks[0].mixer.norm.gate_before_norm = False


def _a_log(model):
    with torch.no_grad():
        model.blocks[2].mixer.A_log.add_(0.5)   # -exp(A_log) is a copy


def _conv_act(model):
    model.blocks[0].mixer.conv.activation = None


def _switch(model):
    model.blocks[2].mixer.compiled_decode = False


def _hook(model):
    model.blocks[0].mixer.conv.register_forward_hook(lambda *a: None)


CAUSES = {"dt_limit": _dt_limit, "D per channel": _d_per_channel, "the norm's order": _norm_order,
          "A_log in place": _a_log, "the conv's activation": _conv_act, "switch": _switch, "hook on the conv": _hook}


@pytest.mark.parametrize("cause", list(CAUSES))
def test_guard_invalidates_for_each_mamba2_cause(cause, monkeypatch):
    dk.check_guard(_model(**CASES["defaults"]), CAUSES[cause], monkeypatch)


def test_in_place_update_of_weights_read_in_place_needs_no_rebuild():
    """in_proj, D and dt_bias are read in place: an in-place update between two tokens of one cache is seen without
    a rebuild."""
    def update(m):
        m.blocks[0].mixer.in_proj.weight.mul_(1.5)
        m.blocks[2].mixer.D.add_(1.0)
        m.blocks[2].mixer.dt_bias.sub_(1.0)

    dk.check_update_in_place_without_rebuild(_model(**CASES["defaults"]), update)


@pytest.mark.parametrize("mode,group", [("int8", None), ("int4", 32)])
def test_quantized_weights(mode, group, monkeypatch):
    """in_proj and o_proj stored quantized (read in place, each in its format; 16 heads: int4's shape rules take
    in_proj's z | xBC | dt rows)."""
    model = dk.hybrid("mamba2", torch.float32, dict(state_size=16, head_dim=4), pattern=(0, 0), d_model=64,
                      ffn_hidden=64, n_heads=16)
    q = quantize(model, mode, group_size=group, compute="fp32", activations="float")
    assert {f"blocks.{i}.mixer.{n}" for i in (0, 1) for n in ("in_proj", "o_proj")} <= set(quantized_modules(q))
    dk.check_quantized(q, monkeypatch)


def test_generate_matches_the_pytorch_path():
    dk.check_generate(_model(**CASES["groups, D per channel, norm before gate, biases, dt clamp"]))


def test_rope_steps_aside(monkeypatch):
    """Mamba2 with RoPE on B / C is not what the compiled step computes: the PyTorch path decodes that model."""
    dk.check_steps_aside(_model(state_size=16, rope=True), monkeypatch)


def test_hostile_values_propagate():
    """dt at its extremes (softplus past its threshold, decay 0; dt ~ 0, decay 1) gives the PyTorch path's values;
    a NaN token poisons its own batch row only."""
    model = _model(torch.float64, **CASES["defaults"])
    with torch.no_grad():
        model.blocks[0].mixer.dt_bias[0] = 50.0
        model.blocks[0].mixer.dt_bias[1] = -1e4
        model.blocks[2].mixer.A_log[0] = 30.0
    dk.assert_matches_twin(model, dk.ids_of(2, 7), 3, tol=1e-10)
    dk.check_nan_token(model)


@pytest.mark.parametrize("op", dk.CACHE_OPS)
def test_cache_operations_between_tokens(op, monkeypatch):
    dk.check_cache_op(_model(**CASES["defaults"]), op, monkeypatch)


def test_two_threads_give_the_same_bits():
    """Batch 4 with heads big enough that the heads' loop and the products run on 2 threads."""
    model = dk.hybrid("mamba2", torch.float32, dict(state_size=64, head_dim=64), pattern=(0, 1, 0), d_model=256,
                      n_heads=4)
    dk.check_threads(model)


def test_bench_decode_torch_twin_takes_the_pytorch_path(monkeypatch):
    """`linattn bench decode --decode-step both`: the `mamba2+torch` row is the PyTorch path (what such a model ran
    before its compiled kind), the `mamba2` row one compiled call per token."""
    import argparse

    from linattn.bench.decode import build_models

    a = argparse.Namespace(vocab_size=64, d_model=32, n_layers=2, n_heads=2, seed=0, device="cpu", decode_step="both")
    models = build_models(a, ["mamba2", "mamba2+torch"])
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(0))
    for name, want in (("mamba2+torch", 0), ("mamba2", 3)):
        calls = CompiledDecodeCalls(monkeypatch)
        dk.decode(models[name], ids, 3)
        assert (calls.model, calls.block) == (want, 0), name
