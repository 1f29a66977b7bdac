"""Training, evaluation, data, tokenizer and checkpoint tests (CPU, tiny models, a few seconds)."""
import json
import os
import signal

import pytest
import torch

from linattn import checkpoint as ckpt
from linattn.data import (
    CorpusError,
    PackedTokens,
    load_tokenizer,
    read_documents,
    split_documents,
    stdlib_documents,
    tokenize_documents,
    train_tokenizer,
)
from linattn.data.corpus import Document
from linattn.generate import generate_text, sample_next
from linattn.training import TrainConfig, TrainError, evaluate, lr_at, prepare_data, train, training_tokens_per_second
from tests.helpers import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")   # tiny matrices: 2 threads on a busy machine are ~100x slower


@pytest.fixture(scope="module")
def tokenizer(corpus):
    return train_tokenizer([corpus.read_text()], vocab_size=300)


def tiny_cfg(corpus, out=None, **kw):
    args = dict(data=str(corpus), out=str(out) if out else None, vocab_size=300, seq_len=32, batch_size=4,
                steps=20, lr=3e-3, warmup=3, log_every=5, save_every=10, eval_every=10, eval_batches=2,
                progress=False)
    args.update(kw)
    return TrainConfig(**args)


# ----------------------------------------------------------------------------- data


def test_tokenizer_roundtrip_save_load(tmp_path, tokenizer):
    text = "def f(x):\n    return x + 1  # héllo ✓\n"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert 257 <= tokenizer.vocab_size <= 300
    p = tokenizer.save(tmp_path / "tokenizer.json")
    tok2 = load_tokenizer(p)
    assert tok2.encode(text) == ids and tok2.eos_id == tokenizer.eos_id
    # deterministic training
    twice = [train_tokenizer([text * 20], vocab_size=280).to_str() for _ in range(2)]
    assert twice[0] == twice[1]


def test_read_split_pack(tmp_path, tokenizer):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    for i in range(12):
        (tmp_path / "d" / ("sub" if i % 2 else "") / f"f{i:02d}.txt").write_text(f"file {i}\n" * 20)
    (tmp_path / "d" / "bin.dat").write_bytes(b"\x00\x01\x02")
    docs = read_documents(tmp_path / "d")
    assert len(docs) == 12 and all(d.name.endswith(".txt") for d in docs)
    assert [d.name for d in docs] == sorted(d.name for d in docs)
    tr, va = split_documents(docs, 0.2)
    assert tr and va and len(tr) + len(va) == 12
    assert split_documents(list(reversed(docs)), 0.2)[1] == list(reversed(va)) or \
        {d.name for d in split_documents(list(reversed(docs)), 0.2)[1]} == {d.name for d in va}
    one_tr, one_va = split_documents([Document("a", "line\n" * 100)], 0.1)
    assert one_tr[0].text + one_va[0].text == "line\n" * 100 and one_va[0].text.strip()
    toks = tokenize_documents(docs, tokenizer)
    assert int((toks == tokenizer.eos_id).sum()) == 12
    packed = PackedTokens(toks, 16)
    x, y = packed.get_batch(3, 4, seed=7)
    assert x.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
    x2, _ = PackedTokens(toks, 16).get_batch(3, 4, seed=7)
    assert torch.equal(x, x2)                                    # a pure function of (seed, step)
    assert not torch.equal(x, packed.get_batch(3, 4, seed=8)[0])
    n = packed.n_windows                                          # an epoch visits every window once
    seen = sorted(i for s in range(n // 2) for i in packed.batch_indices(s, 2, 0))
    assert seen == list(range(2 * (n // 2)))


def test_bad_data(tmp_path):
    with pytest.raises(CorpusError, match="not found"):
        read_documents(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(CorpusError, match="no text"):
        read_documents(tmp_path / "empty.txt")
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(CorpusError, match="no text"):
        read_documents(tmp_path / "emptydir")


def test_stdlib_corpus_deterministic_and_capped():
    a = stdlib_documents(max_bytes=300_000)
    b = stdlib_documents(max_bytes=300_000)
    assert [d.name for d in a] == [d.name for d in b] and a[-1].text == b[-1].text
    assert sum(len(d.text.encode()) for d in a) <= 300_000 and len(a) >= 5
    assert all(d.name.endswith(".py") for d in a)
    assert not any(part in ("site-packages", "test", "tests") for d in a for part in d.name.split("/"))
    tr, va = split_documents(a)
    assert va and tr


# ----------------------------------------------------------------------------- training


def test_lr_schedule():
    cfg = TrainConfig(lr=1.0, warmup=10, steps=110, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.55) and lr_at(110, cfg) == pytest.approx(0.1)


def test_loss_goes_down_and_metrics(tmp_path, corpus):
    cfg = tiny_cfg(corpus, tmp_path / "run", steps=30, eval_every=15, save_every=0)
    res = train(cfg, tiny_model())
    first = sum(loss for _, loss in res.losses[:3]) / 3
    last = sum(loss for _, loss in res.losses[-3:]) / 3
    assert res.step == 30 and last < first - 1.0, (first, last)
    assert res.val_loss is not None and res.val_loss < first and res.tokens_per_s > 0
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [5, 10, 15, 20, 25, 30]
    assert all({"step", "loss", "lr", "tokens_per_s"} <= set(r) for r in recs)
    assert "val_loss" in recs[2] and "val_ppl" in recs[-1]
    ck_dir = tmp_path / "run" / "step_00000030"
    assert sorted(os.listdir(ck_dir)) == ["config.json", "model.safetensors", "tokenizer.json", "training_state.pt"]
    # evaluate() on the loaded checkpoint reproduces the final validation loss
    ck = ckpt.load_checkpoint(tmp_path / "run")
    data = prepare_data(cfg, ck.tokenizer)
    ev = evaluate(ck.model, data.val, batch_size=cfg.batch_size, max_batches=cfg.eval_batches)
    assert ev.loss == pytest.approx(res.val_loss, rel=1e-5)
    text, stats = generate_text(ck.model, ck.tokenizer, "alpha = ", max_new_tokens=8, seed=0, temperature=0.8)
    assert stats["tokens"] == 8 and isinstance(text, str)


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), (k, (a[k] - b[k]).abs().max())


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, corpus):
    """20 uninterrupted steps of a MoE + Hyper-Link model (aux loss, dropout-free)."""
    out = tmp_path_factory.mktemp("straight")
    mc = tiny_model(ffn="moe", n_experts=2, top_k=1, residual="hyperlink")
    # module-scoped fixtures run before the function-scoped one_thread: use the tests' single thread
    # here too, since a different thread count changes the float reduction order (no bitwise match)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        res = train(tiny_cfg(corpus, out / "run"), mc)
    finally:
        torch.set_num_threads(n)
    return mc, res


def test_resume_equals_uninterrupted(tmp_path, corpus, straight_run):
    mc, full = straight_run
    cfg = tiny_cfg(corpus, tmp_path / "run", save_every=7)
    part = train(cfg, mc, should_stop=lambda step: step == 10)      # stop request after step 10
    assert part.interrupted and part.step == 10
    assert (tmp_path / "run" / "step_00000010").is_dir()             # saved on the stop request
    rest = train(cfg, None, resume=True)                             # model config from the checkpoint
    assert rest.resumed_from == 10 and rest.step == 20 and not rest.interrupted
    _assert_same_weights(_weights(full.model), _weights(rest.model))
    assert [loss for _, loss in rest.losses] == [loss for _, loss in full.losses[10:]]
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [5, 10, 15, 20]


def test_sigterm_saves_and_resumes(tmp_path, corpus, straight_run):
    mc, full = straight_run
    cfg = tiny_cfg(corpus, tmp_path / "run", log_every=1)

    def on_log(rec):
        if rec["step"] == 6:
            os.kill(os.getpid(), signal.SIGTERM)   # the handler only sets a flag: the step finishes

    part = train(cfg, mc, on_log=on_log)
    assert part.interrupted and part.signal == signal.SIGTERM and part.step == 6
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or callable(signal.getsignal(signal.SIGTERM))
    rest = train(cfg, None, resume=True)
    assert rest.step == 20
    _assert_same_weights(_weights(full.model), _weights(rest.model))


def test_occupied_out_dir_and_mismatch(tmp_path, corpus, straight_run):
    mc, _ = straight_run
    out = tmp_path / "run"
    train(tiny_cfg(corpus, out, steps=4, save_every=0), tiny_model())
    before = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    with pytest.raises(TrainError, match="--resume"):
        train(tiny_cfg(corpus, out, steps=4), tiny_model())
    with pytest.raises(TrainError, match="mismatch: lr"):
        train(tiny_cfg(corpus, out, steps=8, lr=1e-2), None, resume=True)
    with pytest.raises(TrainError, match="mismatch: model d_model"):
        train(tiny_cfg(corpus, out, steps=8), tiny_model(d_model=64), resume=True)
    after = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    assert before == after                                           # nothing overwritten
    res = train(tiny_cfg(corpus, out, steps=3, save_every=0), tiny_model(), overwrite=True)
    assert res.step == 3 and [c.name for c in ckpt.list_checkpoints(out)] == ["step_00000003"]


def test_atomic_checkpoint_survives_crash(tmp_path, monkeypatch):
    model = torch.nn.Linear(4, 3)
    run = tmp_path / "run"
    ckpt.save_checkpoint(run, 10, model, model_config={"n": 1}, training_state={"step": 10})
    good = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)

    def crash(*a, **k):
        raise OSError("simulated crash mid-save")

    monkeypatch.setattr(ckpt.torch, "save", crash)                    # dies while writing the files
    with pytest.raises(OSError):
        ckpt.save_checkpoint(run, 20, model, model_config={"n": 1}, training_state={"step": 20})
    monkeypatch.undo()
    real_replace = os.replace

    def crash_on_dir_rename(src, dst):
        if str(dst).endswith("step_00000020"):
            raise OSError("simulated crash before the rename")
        return real_replace(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", crash_on_dir_rename)     # dies after writing, before commit
    with pytest.raises(OSError):
        ckpt.save_checkpoint(run, 20, model, model_config={"n": 1}, training_state={"step": 20})
    monkeypatch.undo()
    assert ckpt.find_latest_checkpoint(run) == run / "step_00000010"
    assert not list(run.glob(".tmp_*"))
    fresh = torch.nn.Linear(4, 3)
    ck = ckpt.load_checkpoint(run, model_factory=lambda d: fresh, with_training_state=True)
    assert ck.step == 10 and ck.training_state["step"] == 10
    _assert_same_weights(good, fresh.state_dict())
    # a stale 'latest' (pointing at a folder that never got written) falls back to the newest complete one
    (run / "latest").write_text("step_00000099\n")
    assert ckpt.find_latest_checkpoint(run) == run / "step_00000010"


def test_corrupt_checkpoint_is_a_clean_error(tmp_path):
    run = tmp_path / "run"
    model = torch.nn.Linear(4, 3)
    d = ckpt.save_checkpoint(run, 1, model, model_config={"n": 1})
    (d / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ckpt.CheckpointError, match="cannot read"):
        ckpt.load_checkpoint(run, model_factory=lambda _: torch.nn.Linear(4, 3))
    with pytest.raises(ckpt.CheckpointError, match="no readable checkpoint"):
        ckpt.load_checkpoint(tmp_path)


def test_sampling_filters():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    assert int(sample_next(logits, 0.0)) == 3
    g = torch.Generator().manual_seed(0)
    draws = {int(sample_next(logits, 1.0, top_k=2, generator=g)) for _ in range(50)}
    assert draws <= {2, 3}
    draws = {int(sample_next(logits, 1.0, top_p=0.5, generator=g)) for _ in range(50)}
    assert draws == {3}


def test_training_tokens_per_second():
    r = training_tokens_per_second(tiny_model(), seq_len=32, batch_size=2, steps=2, warmup=1, return_all=True)
    assert r["tokens_per_s"] > 0 and len(r["step_s"]) == 2 and r["n_params"] > 0
