"""Training switches on one process: gradient accumulation, document boundaries in packed windows,
bf16 autocast with float32 master weights, activation checkpointing, and the optimizer state that
loads across process layouts (CPU, tiny models)."""
from __future__ import annotations

import copy

import pytest
import torch

from linattn.models import LanguageModel, LMConfig
from linattn.training import TrainConfig, Trainer, TrainError
from linattn.training.trainer import document_offsets, forward_logits

EOS = 0


pytestmark = pytest.mark.usefixtures("one_thread")


def model(mixer=("gated-deltanet", "softmax"), **kw):
    torch.manual_seed(0)
    return LanguageModel(LMConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=2, mixer=list(mixer),
                                  max_seq_len=32, **kw))


def cfg(**kw):
    args = dict(seq_len=16, batch_size=4, steps=6, lr=3e-3, warmup=1, device="cpu", progress=False)
    args.update(kw)
    return TrainConfig(**args)


def batch(step, b=4, t=16):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(1, 32, (b, t + 1), generator=g)
    x[:, 5] = EOS   # documents end inside the windows
    return x[:, :-1], x[:, 1:]


def run(trainer, steps=4):
    return [trainer.train_step(*batch(s)).loss for s in range(steps)]


def test_grad_accum_gives_the_same_steps():
    one = run(Trainer(model(), cfg(), eos_id=EOS))
    four = run(Trainer(model(), cfg(grad_accum=4), eos_id=EOS))
    assert max(abs(a - b) / a for a, b in zip(one, four)) < 1e-5
    with pytest.raises(TrainError, match="divisible"):
        Trainer(model(), cfg(grad_accum=3))


def test_document_logits_do_not_depend_on_the_document_before():
    m = model().eval()
    b = torch.randint(1, 32, (1, 9))
    x1 = torch.cat([torch.randint(1, 32, (1, 6)), torch.tensor([[EOS]]), b], 1)
    x2 = torch.cat([torch.randint(1, 32, (1, 6)), torch.tensor([[EOS]]), b], 1)
    assert document_offsets(x1, EOS).tolist() == [0, 6, 16]
    with torch.no_grad():
        l1, _ = forward_logits(m, x1, EOS)
        l2, _ = forward_logits(m, x2, EOS)
        alone, _ = forward_logits(m, torch.cat([torch.tensor([[EOS]]), b], 1), EOS)
        f1, _ = forward_logits(m, x1)   # boundaries off: the first document leaks into the second
        f2, _ = forward_logits(m, x2)
    torch.testing.assert_close(l1[:, 6:], l2[:, 6:], rtol=0, atol=1e-6)
    torch.testing.assert_close(l1[:, 6:], alone, rtol=1e-5, atol=1e-5)
    assert (f1[:, 6:] - f2[:, 6:]).abs().max() > 1e-4
    # rows of a batch are documents of their own, and the flag switches the packing off
    assert document_offsets(torch.ones(2, 4, dtype=torch.long), EOS).tolist() == [0, 4, 8]
    assert Trainer(model(), cfg(doc_boundaries=False), eos_id=EOS).eos_id is None
    on = run(Trainer(model(), cfg(), eos_id=EOS), 1)
    assert on[0] != run(Trainer(model(), cfg(doc_boundaries=False), eos_id=EOS), 1)[0]


def test_bf16_keeps_float32_weights_and_optimizer_state():
    t = Trainer(model(), cfg(dtype="bf16"), eos_id=EOS)
    assert t.config.dtype == "bfloat16"
    losses = run(t, 3)
    assert all(l == l for l in losses)  # noqa: E741 - finite
    assert all(p.dtype == torch.float32 for p in t.model.parameters())
    states = [v for s in t.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    assert states and all(v.dtype == torch.float32 for v in states)
    ref = run(Trainer(model(), cfg(), eos_id=EOS), 3)
    assert abs(losses[0] - ref[0]) < 0.05 * ref[0]


def test_activation_checkpointing_same_step():
    ref = run(Trainer(model(), cfg(), eos_id=EOS), 2)
    t = Trainer(model(), cfg(activation_checkpointing=True), eos_id=EOS)
    assert t.model.activation_checkpointing
    assert max(abs(a - b) / a for a, b in zip(ref, run(t, 2))) < 1e-6


def test_optimizer_state_by_name_loads_into_a_plain_model():
    """The layout FSDP checkpoints use (full state keyed by parameter name) resumes in one process."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    a = Trainer(model(), cfg(), eos_id=EOS)
    run(a, 2)
    by_name = get_optimizer_state_dict(a.model, a.optimizer, options=StateDictOptions(full_state_dict=True))
    assert all(isinstance(k, str) for k in by_name["state"])
    state = copy.deepcopy(dict(a.state_dict(), optimizer=by_name))   # (a's live tensors: a steps on)
    b = Trainer(model(), cfg(), eos_id=EOS)
    b.model.load_state_dict(a.model.state_dict())
    b.load_state_dict(state)
    assert [a.train_step(*batch(s)).loss for s in (2, 3)] == [b.train_step(*batch(s)).loss for s in (2, 3)]
