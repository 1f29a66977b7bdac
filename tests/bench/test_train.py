"""`linattn bench train --quick` end to end (no timing assertions: the machine's speed is not tested)."""
import json

from linattn.cli import main


def test_bench_train_quick(tmp_path, capsys):
    rc = main(["bench", "train", "--quick", "--mixers", "softmax,gated-deltanet,linear-elu+1", "--out", str(tmp_path),
               "--quiet"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "vs softmax" in out
    data = json.loads((tmp_path / "train.json").read_text())
    recs = {r["model"]: r for r in data["records"]}
    assert set(recs) == {"softmax", "gated-deltanet", "linear-elu+1"}
    for r in recs.values():
        assert "error" not in r and r["tokens_per_s"] > 0 and r["step"]["repeats"] >= 2
        assert r["matmul_flops"] > 0 and 0 < r["mfu"]   # model-FLOPs utilisation against the measured rate
    assert data["config"]["seq_len"] == 64 and data["config"]["batch"] == 2   # --quick's configuration
    assert data["matmul_rate"]["gflops"] > 0 and "mfu" in out


def test_bench_train_unknown_mixer_exits_2(capsys):
    assert main(["bench", "train", "--quick", "--mixers", "nope"]) == 2
    assert "unknown" in capsys.readouterr().err


def test_free_mixer_row_replaces_only_the_attention(tmp_path):
    """The free-mixer model is softmax's with o = q + k + v: same parameters, attention gone (changing
    one token changes that position's output only), and every
    projection still gets a gradient."""
    import argparse

    import torch

    from linattn.bench import train as bt

    a = argparse.Namespace(**bt.QUICK, seed=0, mixers="softmax", free_mixer=True)
    assert bt._mixer_names(a) == ["softmax", bt.FREE_MIXER]
    from linattn.models import LanguageModel, LMConfig
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, mixer="softmax", max_seq_len=64)
    soft = LanguageModel(cfg)
    free = bt._free_mixer_model(LanguageModel(cfg))
    free.load_state_dict(soft.state_dict())
    ids = torch.randint(0, 64, (1, 12))
    y_soft, y_free = soft(ids).logits, free(ids).logits
    assert not torch.allclose(y_soft, y_free)   # the attention is gone
    ids2 = ids.clone()
    ids2[0, 3] = (ids[0, 3] + 1) % 64
    y2 = free(ids2).logits
    changed = (y2 - y_free).abs().amax(-1)[0] > 0
    assert changed.tolist() == [i == 3 for i in range(12)]   # no mixing across tokens
    free(ids, targets=ids).loss.backward()
    for name, p in free.named_parameters():
        assert p.grad is not None, name


def test_bench_train_free_mixer_quick(tmp_path, capsys):
    rc = main(["bench", "train", "--quick", "--mixers", "softmax", "--free-mixer", "--out", str(tmp_path), "--quiet"])
    assert rc == 0
    data = json.loads((tmp_path / "train.json").read_text())
    assert [r["model"] for r in data["records"]] == ["softmax", "free-mixer"]
    assert "free-mixer" in capsys.readouterr().out


def test_step_flops_counts_the_projections_and_attention():
    """The counted matmul FLOPs of a softmax step: at least 6 x tokens x the parameters of the matrix products (two
    for the forward, four for the backward) and more with the attention's T^2 products."""
    import argparse

    import torch

    from linattn.bench import train as bt

    a = argparse.Namespace(**bt.QUICK, seed=0)
    step, _ = bt.make_step("softmax", a)
    fl = bt.step_flops(step)
    # the dense weights a token passes through: every 2-D parameter but the embedding table
    from linattn.models import LanguageModel, LMConfig
    torch.manual_seed(0)
    m = LanguageModel(LMConfig(vocab_size=a.vocab_size, d_model=a.d_model, n_layers=a.n_layers, n_heads=a.n_heads,
                               mixer="softmax", max_seq_len=2048))
    model_params = sum(p.numel() for n, p in m.named_parameters() if p.dim() == 2 and "emb" not in n)
    tokens = a.batch * a.seq_len
    assert fl >= 6 * tokens * model_params * 0.9
    # the attention's products, counted in full as torch counts SDPA: forward QK^T and AV (2 x 2 T^2 d per layer),
    # backward five (the scores again, dV, dP, dQ, dK): 14 B T^2 d per layer
    attn = 14 * a.batch * a.seq_len ** 2 * a.d_model * a.n_layers
    free, _ = bt.make_step(bt.FREE_MIXER, a)
    assert abs((fl - bt.step_flops(free)) / attn - 1) < 1e-3


def test_bench_train_profile_prints_the_table(tmp_path, capsys):
    rc = main(["bench", "train", "--quick", "--mixers", "softmax", "--profile", "5", "--out", str(tmp_path), "--quiet"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "in matrix products" in out and "aten::mm" in out
    data = json.loads((tmp_path / "train.json").read_text())
    assert 0 < data["records"][0]["profile"]["matmul_share"] <= 1


def test_free_core_rows_replace_only_the_operator():
    """free:<mixer> is the mixer's own model with only its operator call costing nothing: same parameters, outputs
    differ from the real model's, no mixing beyond the short convolution's window, every parameter still reached by
    the backward, and the operator is back in place after the step."""
    import argparse

    import torch

    import linattn.layers.delta as layers_delta
    from linattn.bench import train as bt
    from linattn.models import LanguageModel, LMConfig

    a = argparse.Namespace(**bt.QUICK, seed=0, mixers="softmax,gated-deltanet,linear-elu+1,kda", free_mixer=True)
    assert bt._mixer_names(a) == ["softmax", "gated-deltanet", "linear-elu+1", "kda", bt.FREE_MIXER,
                                  "free:gated-deltanet", "free:linear-elu+1"]   # kda's layer calls no FREE_CORES op
    torch.manual_seed(0)
    model = LanguageModel(LMConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, mixer="gated-deltanet",
                                   max_seq_len=64))
    ids = torch.randint(0, 64, (1, 16))
    y_real = model(ids).logits
    real_op = layers_delta.delta_rule
    with bt.freed_core(bt.free_core_of("gated-deltanet")):
        assert layers_delta.delta_rule is bt.free_core
        y_free = model(ids).logits
        ids2 = ids.clone()
        ids2[0, 3] = (ids[0, 3] + 1) % 64
        changed = ((model(ids2).logits - y_free).abs().amax(-1)[0] > 0).tolist()
        model(ids, targets=ids).loss.backward()
    assert layers_delta.delta_rule is real_op
    assert not torch.allclose(y_real, y_free)
    # two layers of a kernel-4 causal convolution reach 6 tokens ahead; no token before the changed one moves
    assert changed == [3 <= i <= 3 + 2 * 3 for i in range(16)]
    for name, p in model.named_parameters():
        assert p.grad is not None, name


def test_free_core_backward_passes_the_gradient_to_v():
    import torch

    from linattn.bench import train as bt

    q, k = torch.randn(2, 5, 3, 4, requires_grad=True), torch.randn(2, 5, 3, 4, requires_grad=True)
    v, beta = torch.randn(2, 5, 3, 6, requires_grad=True), torch.rand(2, 5, 3, requires_grad=True)
    o, state = bt.free_core(q, k, v, beta, g=None, scale=0.5)
    assert state is None and torch.equal(o, v) and o.data_ptr() != v.data_ptr()
    w = torch.randn_like(o)
    (o * w).sum().backward()
    assert torch.equal(v.grad, w)
    for t in (q, k, beta):
        assert torch.equal(t.grad, torch.zeros_like(t))


def test_bench_train_free_core_quick(tmp_path, capsys):
    rc = main(["bench", "train", "--quick", "--mixers", "softmax,gated-deltanet", "--free-mixer", "--out",
               str(tmp_path), "--quiet"])
    assert rc == 0
    data = json.loads((tmp_path / "train.json").read_text())
    recs = {r["model"]: r for r in data["records"]}
    assert list(recs) == ["softmax", "gated-deltanet", "free-mixer", "free:gated-deltanet"]
    assert recs["free:gated-deltanet"]["params"] == recs["gated-deltanet"]["params"]
    ratio = recs["gated-deltanet"]["tokens_per_s"] / recs["free:gated-deltanet"]["tokens_per_s"]
    assert abs(recs["gated-deltanet"]["of_bound"] / ratio - 1) < 1e-12
    assert "of_bound" not in recs["softmax"] and "of bound" in capsys.readouterr().out
