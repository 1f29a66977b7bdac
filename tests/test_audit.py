"""The causality audit, and the ELA memory lobe's "sudden drop" shown to be a leak."""
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from linattn.audit import CausalityReport, check_causality
from linattn.models import LanguageModel, LMConfig

pytestmark = pytest.mark.usefixtures("one_thread_module")


def lobe_model(lobe, **kw):
    args = dict(vocab_size=16, d_model=32, n_layers=1, n_heads=2, mixer="linear-elu+1", residual="hyperlink",
                memory_lobe=lobe, allow_future_leak=True, final_norm=False)
    args.update(kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LanguageModel(LMConfig(**args))


def test_report_on_causal_model():
    model = lobe_model("causal")
    model.train()
    report = check_causality(model, seq_len=12)
    assert isinstance(report, CausalityReport) and report.ok and bool(report)
    assert report.offending_positions == [] and report.cuts == list(range(11))
    assert "passed" in str(report) and "float64" in str(report)
    assert model.training and model.embed.weight.dtype == torch.float32  # the caller's model is untouched


def test_audit_catches_a_leak_at_initialisation():
    # a freshly initialised bidirectional lobe changes earlier logits by only ~1e-6: the float64
    # audit still sees it, at every position (each one reads the whole sequence)
    report = check_causality(lobe_model("bidirectional"), seq_len=12)
    assert not report.ok
    assert report.offending_positions == list(range(11))
    assert report.leaks[5] == list(range(6))
    assert "FAILED" in str(report) and "offending positions" in str(report)


def test_audit_plain_callables_and_args():
    W = torch.randn(5, 7)

    def causal(ids):  # cumulative mean of one-hot tokens
        x = F.one_hot(ids, 5).double()
        return (x.cumsum(1) / torch.arange(1, ids.shape[1] + 1).view(1, -1, 1)) @ W.double()

    def peeks(ids):  # position t also sees token t + 1
        x = F.one_hot(ids, 5).double()
        return (x + torch.roll(x, -1, dims=1)) @ W.double()

    assert check_causality(causal, seq_len=8, vocab_size=5).ok
    bad = check_causality(peeks, seq_len=8, vocab_size=5, cuts=[2, 4])
    assert not bad.ok and bad.offending_positions == [2, 4] and bad.leaks == {2: [2], 4: [4]}
    with pytest.raises(ValueError, match="vocab_size"):
        check_causality(causal, seq_len=8)
    with pytest.raises(ValueError, match="cuts"):
        check_causality(causal, seq_len=8, vocab_size=5, cuts=[7])


def test_sudden_drop_is_a_leak():
    """The seed's 'sudden drop' in loss comes from the bidirectional memory lobe reading the future.

    Data: [BOS, c, c, ..., c] with c uniform over 15 tokens. The first target (c, predicted from
    BOS alone) is unknowable from the prefix: any causal model's loss there stays at ln 15 = 2.71.
    With the bidirectional lobe the loss at that position collapses, so does the mean loss below
    the causal floor, and the audit flags the model; with the causal lobe nothing of the kind.
    """
    V, T, B = 16, 16, 32
    floor = math.log(V - 1)
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(60):
        c = torch.randint(1, V, (B, 1), generator=g)
        ids = c.expand(B, T).clone()
        ids[:, 0] = 0
        batches.append(ids)
    result = {}
    for lobe in ("causal", "bidirectional"):
        torch.manual_seed(0)
        model = lobe_model(lobe)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        first, mean = [], []
        for ids in batches:
            logits = model(ids[:, :-1]).logits
            loss = F.cross_entropy(logits.reshape(-1, V), ids[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            first.append(F.cross_entropy(logits[:, 0].detach(), ids[:, 1]).item())
            mean.append(loss.item())
        result[lobe] = (sum(first[-5:]) / 5, sum(mean[-5:]) / 5, check_causality(model, seq_len=8).ok)
    causal_first, causal_mean, causal_ok = result["causal"]
    leaky_first, leaky_mean, leaky_ok = result["bidirectional"]
    assert causal_ok and not leaky_ok
    assert causal_first > floor - 0.4          # the unknowable target stays unknowable
    assert causal_mean > floor / (T - 1) - 0.05  # so the mean loss has a floor
    assert leaky_first < floor / 2             # ...unless the model reads the future
    assert leaky_mean < floor / (T - 1)        # below what any causal model can reach
