"""`Trainer`: one causal LM (`linattn.models.family.CausalLM`), its AdamW optimizer and the
training position, with THE training step (`train_step`), evaluation, and the training state a
checkpoint stores (`state_dict` / `load_state_dict`). `train()` and `training_tokens_per_second()`
both step through it.

    trainer = Trainer(build_model(model_config), TrainConfig(lr=3e-4, steps=1000))
    out = trainer.train_step(x, y)        # StepOutput(step, loss, lr, grad_norm, aux_loss)
    trainer.evaluate(val_tokens)          # EvalResult(loss, ppl, tokens, batches)
    state = trainer.state_dict()          # optimizer, step, RNG states, loss accumulator, ...
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Union

import torch
import torch.nn.functional as F

from ..data.corpus import CorpusError, PackedTokens
from ..errors import CheckpointError
from ..models.family import build_model
from .config import TrainConfig, TrainError, TrainingDiverged, resolve_device
from .schedule import autocast, lr_at, make_optimizer, set_lr


@dataclass
class EvalResult:
    loss: float                           # mean next-token cross-entropy, nats/token
    ppl: float
    tokens: int
    batches: int

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class StepOutput:
    step: int                             # steps done, this one included
    loss: float                           # the step's cross-entropy (before the aux loss)
    lr: float
    grad_norm: Optional[float]            # before clipping; None without clipping
    aux_loss: Optional[float]             # the model's auxiliary loss (MoE load balancing)


def _model_device(model: torch.nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: Union[PackedTokens, torch.Tensor], *, batch_size: int = 8,
             max_batches: Optional[int] = None, seq_len: Optional[int] = None,
             device: Optional[Union[str, torch.device]] = None, dtype: str = "float32") -> EvalResult:
    """Mean next-token cross-entropy (nats/token) and perplexity of `model` on `data`.

    `data` is a PackedTokens (its windows in order) or a 1-D token tensor (cut into `seq_len`
    windows). Deterministic; the model's train/eval mode is restored afterwards.
    """
    if isinstance(data, torch.Tensor):
        if seq_len is None:
            raise TrainError("evaluate(tensor) needs seq_len")
        data = PackedTokens(data, seq_len, name="the evaluation data")
    device = torch.device(device) if device is not None else _model_device(model)
    was_training = model.training
    model.eval()
    total, count, nb = 0.0, 0, 0
    try:
        for x, y in data.eval_batches(batch_size, max_batches):
            x, y = x.to(device), y.to(device)
            with autocast(device, dtype):
                logits = model(x).logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")
            total += float(loss.item())
            count += y.numel()
            nb += 1
    finally:
        model.train(was_training)
    if count == 0:
        raise CorpusError("no evaluation windows")
    mean = total / count
    return EvalResult(loss=mean, ppl=math.exp(min(mean, 700.0)), tokens=count, batches=nb)


class Trainer:
    """A model, its optimizer, and where training stands (step, tokens, logging-interval loss)."""

    def __init__(self, model: torch.nn.Module, config: TrainConfig,
                 device: Optional[Union[str, torch.device]] = None):
        config.validate()
        self.config = config
        self.device = torch.device(device) if device is not None else resolve_device(config.device)
        self.model = model.to(self.device)
        self.optimizer = make_optimizer(self.model, config)
        self.step = 0                     # optimizer steps done
        self.tokens_seen = 0
        self.loss_sum, self.loss_count = 0.0, 0   # the current logging interval
        self._elapsed_before = 0.0       # training seconds of earlier sessions (from a checkpoint)
        self._clock: Optional[float] = None

    # -- the training step ----------------------------------------------------------------------
    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> StepOutput:
        """One optimizer step on inputs `x` [B, T] and targets `y` [B, T] at the scheduled lr."""
        cfg, dev = self.config, self.device
        lr = lr_at(self.step, cfg)
        set_lr(self.optimizer, lr)
        x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        self.model.train()
        with autocast(dev, cfg.dtype):
            out = self.model(x)
        logits, aux = out.logits, getattr(out, "aux_loss", None)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        total = loss + aux.float() if aux is not None else loss
        self.optimizer.zero_grad(set_to_none=True)
        total.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip) if cfg.grad_clip > 0 else None
        self.optimizer.step()
        value = float(loss.detach().float().item())
        if not math.isfinite(value):
            raise TrainingDiverged(f"training loss is {value} at step {self.step + 1} (try a lower --lr)")
        self.step += 1
        self.tokens_seen += x.numel()
        self.loss_sum += value
        self.loss_count += 1
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return StepOutput(step=self.step, loss=value, lr=lr,
                          grad_norm=float(gnorm) if gnorm is not None else None,
                          aux_loss=float(aux.detach().float()) if aux is not None else None)

    def interval_loss(self) -> float:
        """Mean training loss since the last call (the logging interval), then reset."""
        mean = self.loss_sum / max(1, self.loss_count)
        self.loss_sum, self.loss_count = 0.0, 0
        return mean

    def evaluate(self, data: PackedTokens, max_batches: Optional[int] = None) -> EvalResult:
        """Validation loss on `data` with the run's batch size, dtype and `eval_batches`."""
        cfg = self.config
        return evaluate(self.model, data, batch_size=cfg.batch_size, device=self.device, dtype=cfg.dtype,
                        max_batches=cfg.eval_batches if max_batches is None else max_batches)

    # -- time -------------------------------------------------------------------------------------
    def start_clock(self) -> None:
        self._clock = time.perf_counter()

    def elapsed_s(self) -> float:
        """Training wall time of the whole run: earlier sessions plus this one since start_clock()."""
        now = time.perf_counter() - self._clock if self._clock is not None else 0.0
        return self._elapsed_before + now

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The training state beside the weights (those are `model.state_dict()`, saved as safetensors)."""
        return {"step": self.step, "optimizer": self.optimizer.state_dict(), "torch_rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state_all() if self.device.type == "cuda" else None,
                "loss_acc": [self.loss_sum, self.loss_count], "tokens_seen": self.tokens_seen,
                "elapsed_s": self.elapsed_s()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue from `state_dict()`'s output: the next step is then exactly the saved run's next."""
        try:
            self.optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError, RuntimeError) as e:
            raise CheckpointError(f"the optimizer state does not fit the model: {e}") from None
        self.step = int(state["step"])
        self.loss_sum, self.loss_count = (float(v) for v in state.get("loss_acc", [0.0, 0]))
        self.loss_count = int(self.loss_count)
        self.tokens_seen = int(state.get("tokens_seen", 0))
        self._elapsed_before = float(state.get("elapsed_s", 0.0))
        torch.set_rng_state(state["torch_rng"])
        if state.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(list(state["cuda_rng"]))


def training_tokens_per_second(model_config, *, seq_len: int = 512, batch_size: int = 2, steps: int = 5,
                               warmup: int = 2, device: Optional[str] = None, dtype: str = "float32",
                               lr: float = 1e-4, seed: int = 0,
                               model_factory: Optional[Callable[[Any], torch.nn.Module]] = None,
                               return_all: bool = False):
    """Median training tokens/s (`Trainer.train_step`: forward, backward, clip, AdamW) on random tokens.

    `model_config` is a model-family config (or dict), or a built model. Runs `warmup` untimed
    steps, then `steps` timed ones. Returns the median tokens/s, or with return_all a dict with
    the per-step times, the parameter count and the median.
    """
    dev = resolve_device(device)
    torch.manual_seed(seed)
    if isinstance(model_config, torch.nn.Module):
        model = model_config
    else:
        model = (model_factory or build_model)(model_config)
    cfg = TrainConfig(lr=lr, min_lr_ratio=1.0, warmup=0, steps=warmup + steps, seq_len=seq_len,
                      batch_size=batch_size, dtype=dtype, seed=seed)
    trainer = Trainer(model, cfg, dev)
    vocab = int(model.config.vocab_size)
    g = torch.Generator().manual_seed(seed)
    times = []
    for i in range(warmup + steps):
        x = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=g).to(dev)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        trainer.train_step(x[:, :-1], x[:, 1:])
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    med = batch_size * seq_len / statistics.median(times)
    if return_all:
        return {"tokens_per_s": med, "step_s": times, "n_params": model.num_parameters(),
                "seq_len": seq_len, "batch_size": batch_size, "device": str(dev)}
    return med


__all__ = ["Trainer", "StepOutput", "EvalResult", "evaluate", "training_tokens_per_second"]
