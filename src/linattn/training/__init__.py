"""Language-model training, evaluation and training-throughput measurement, with the
`linattn train` / `linattn eval` command lines (`training.cli`).

    from linattn.training import TrainConfig, train, evaluate, prepare_data, training_tokens_per_second
    cfg = TrainConfig(data="corpus/", out="runs/efla", seq_len=256, batch_size=8, steps=2000)
    res = train(cfg, LMConfig(vocab_size=4096, d_model=256, n_layers=4, n_heads=4, mixer="efla"))
    res.val_loss, res.tokens_per_s, res.model
    evaluate(res.model, prepare_data(cfg).val)           # -> EvalResult(loss, ppl, tokens, batches)
    training_tokens_per_second(model_config, seq_len=512, batch_size=2)   # median tokens/s

Any registered model family trains the same way (`linattn.models.family`): the model config picks
the model, checkpoints record the family, and resume/eval/generate rebuild it from the checkpoint.

What a run does: reads the data (a file, a folder, or with no data the Python standard library,
see `linattn.data.corpus`), trains a byte-level BPE tokenizer on the training split (or loads one),
packs the documents into `seq_len` windows, and trains with AdamW (decoupled weight decay on
matrices only), linear warmup then cosine decay to `min_lr_ratio * lr`, gradient-norm clipping,
periodic validation loss/perplexity, a tqdm bar with tokens/s, `out/metrics.jsonl`, and atomic
checkpoints (`linattn.checkpoint`); exact resume and signal handling are described in `loop`.

The modules:

    config.py    TrainConfig (documented fields), TrainError, resume compatibility, resolve_device
    schedule.py  lr_at (warmup + cosine), make_optimizer (AdamW, fused where torch has it), autocast
    data.py      TrainData, prepare_data
    run.py       RunFolder (out dir checks, clearing, metrics.jsonl), read_metrics, StopFlag (signals)
    trainer.py   Trainer (train_step / evaluate / state_dict / load_state_dict), evaluate,
                 training_tokens_per_second; grad accumulation, bf16 autocast, activation
                 checkpointing, torch.compile, document boundaries (cu_seqlens), DDP / FSDP2
    distributed.py  Dist: the torchrun process group (gloo on CPU, nccl on GPU) and its collectives
    loop.py      train(): a whole run around a Trainer (rank 0 writes metrics and checkpoints)
    cli.py       `linattn train` / `linattn eval` (flags generated from the config dataclasses)

Several processes: `torchrun --nproc_per_node=N -m linattn train ...`; `batch_size` is the global
batch, so 1 and N processes give the same losses (see `loop` and `trainer`).
"""
from .config import TrainConfig, TrainError, TrainingDiverged, resolve_device
from .data import TrainData, prepare_data, rank_batch
from .distributed import Dist
from .loop import TrainResult, train
from .run import METRICS_FILE, read_metrics
from .schedule import lr_at, make_optimizer
from .trainer import EvalResult, StepOutput, Trainer, evaluate, training_tokens_per_second

__all__ = [
    "TrainConfig", "train", "evaluate", "prepare_data", "TrainData", "TrainResult", "EvalResult", "read_metrics",
    "METRICS_FILE", "training_tokens_per_second", "resolve_device", "TrainError", "TrainingDiverged", "Trainer",
    "StepOutput", "lr_at", "make_optimizer", "Dist", "rank_batch",
]
