"""linattn.hf.kernelize under the usual fine-tuning recipe (issue 45.2): packed documents (restarting position_ids,
DataCollatorWithFlattening's convention) with gradient checkpointing, reentrant and not, and through the Trainer's
own `gradient_checkpointing=True`: the same loss and gradients as without checkpointing, for every served
architecture (Mamba2ForCausalLM, which does not pass its kwargs to its backbone, included)."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.hf.kernelize_models import (  # noqa: E402
    ARCHS,
    ids as _ids,
    maxdiff as _maxdiff,
    pair,
    transformers_torch_code,  # noqa: E402, F401  (autouse)
)


def _packed_batch():
    docs = [_ids(30, 9, 1), _ids(31, 5, 1), _ids(32, 7, 1)]
    ids = torch.cat(docs, dim=1)
    pos = torch.cat([torch.arange(d.shape[1]) for d in docs])[None]
    return docs, ids, pos


def _loss_and_grads(model, ids, pos):
    model.zero_grad(set_to_none=True)
    loss = model(ids, position_ids=pos, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_with_gradient_checkpointing(arch):
    """Packed loss and gradients with checkpointing (reentrant and not) = without; and the packed logits of
    each document = that document alone, so the reference itself keeps the documents apart."""
    _, fast, _ = pair(arch)
    docs, ids, pos = _packed_batch()
    fast.train()
    with torch.no_grad():
        packed = fast(ids, position_ids=pos, use_cache=False).logits
        alone = torch.cat([fast(d, use_cache=False).logits for d in docs], dim=1)
    assert _maxdiff(packed, alone) <= 2e-5 * max(1.0, alone.abs().max().item()), arch
    loss0, grads0 = _loss_and_grads(fast, ids, pos)
    assert len(grads0) > 5
    for reentrant in (False, True):
        fast.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        assert any(getattr(m, "gradient_checkpointing", False) for m in fast.modules())
        loss, grads = _loss_and_grads(fast, ids, pos)
        fast.gradient_checkpointing_disable()
        assert abs(loss - loss0) <= 1e-5 * abs(loss0), (arch, reentrant)
        assert grads.keys() == grads0.keys(), (arch, reentrant)
        scale = max(g.abs().max().item() for g in grads0.values())
        worst = max(_maxdiff(grads[n], grads0[n]) for n in grads0)
        assert worst <= 1e-5 * scale, (arch, reentrant, worst / scale)


@pytest.mark.parametrize("arch", ["qwen3_5", "mamba2", "minimax"])
def test_trainer_packed_with_gradient_checkpointing(arch, tmp_path):
    """Trainer(gradient_checkpointing=True) + DataCollatorWithFlattening on a datasets.Dataset: its first loss is
    the packed loss of the same documents without checkpointing."""
    datasets = pytest.importorskip("datasets")
    _, fast, _ = pair(arch)
    docs, _, _ = _packed_batch()
    rows = [d[0].tolist() for d in docs]
    data = datasets.Dataset.from_dict({"input_ids": rows})
    collator = transformers.DataCollatorWithFlattening()
    batch = collator([{"input_ids": r} for r in rows])
    fast.train()
    with torch.no_grad():
        expected = fast(batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                        use_cache=False).loss.item()
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=3, max_steps=1,
                                          learning_rate=1e-3, logging_steps=1, report_to=[], use_cpu=True,
                                          save_strategy="no", disable_tqdm=True, gradient_checkpointing=True)
    trainer = transformers.Trainer(model=fast, args=args, train_dataset=data, data_collator=collator)
    trainer.train()
    assert any(getattr(m, "gradient_checkpointing", False) for m in fast.modules())
    (loss,) = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert loss == pytest.approx(expected, rel=1e-5), arch


@pytest.mark.parametrize("arch", ["qwen3_5", "mamba2"])
def test_unpatched_transformers_mixes_packed_documents(arch):
    """What docs/kernelize.md says of transformers without kernelize (and without fla / mamba_ssm): given restarting
    position_ids alone, its linear mixers run the packed row as one sequence, silently (no error)."""
    ref, _, _ = pair(arch)
    docs, ids, pos = _packed_batch()
    with torch.no_grad():
        packed = ref(ids, position_ids=pos, use_cache=False).logits
        alone = torch.cat([ref(d, use_cache=False).logits for d in docs], dim=1)
    assert _maxdiff(packed, alone) > 1e-3 * alone.abs().max().item(), arch
