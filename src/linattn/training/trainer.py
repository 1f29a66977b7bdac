"""`Trainer`: one causal LM (`linattn.models.family.CausalLM`), its AdamW optimizer and the
training position, with THE training step (`train_step`), evaluation, and the training state a
checkpoint stores (`state_dict` / `load_state_dict`). `train()` and `training_tokens_per_second()`
both step through it.

    trainer = Trainer(build_model(model_config), TrainConfig(lr=3e-4, steps=1000))
    out = trainer.train_step(x, y)        # StepOutput(step, loss, lr, grad_norm, aux_loss)
    trainer.evaluate(val_tokens)          # EvalResult(loss, ppl, tokens, batches)
    state = trainer.state_dict()          # optimizer, step, RNG states, loss accumulator, ...

A step is one optimizer update on the global batch (`TrainConfig.batch_size` windows). With several
processes (`distributed.Dist`) every rank gets its contiguous share of the windows, and the model is
wrapped in DDP or FSDP2 (`fully_shard` on every block, then on the model); `grad_accum` splits each
rank's share into micro-batches whose gradients add up (synchronised on the last one only). The
loss is the mean over the global batch, so the math does not depend on either split. bf16 runs the
forward under autocast: weights, gradients and AdamW state stay float32. With `doc_boundaries` and
an eos id, the rows of a micro-batch are laid end to end in one row with `cu_seqlens` marking every
row start and every `<|endoftext|>`, so no document sees the one before it (`document_offsets`).

Checkpoints hold full (unsharded) tensors: under FSDP the weights and the optimizer state are
gathered to rank 0 (`torch.distributed.checkpoint.state_dict`, full_state_dict + cpu_offload), so a
checkpoint written by N processes loads in one process, under DDP or FSDP, and with any N.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from ..data.corpus import CorpusError, PackedTokens
from ..errors import CheckpointError
from ..models.family import build_model
from ..ops import value_checks_suspended
from .config import TrainConfig, TrainError, TrainingDiverged, resolve_device
from .distributed import Dist
from .schedule import autocast, lr_at, make_optimizer, set_lr


@dataclass
class EvalResult:
    """What `evaluate` returns.

    Attributes:
        loss: The mean next-token cross-entropy, nats/token.
        ppl: The perplexity, exp(loss).
        tokens: The tokens scored.
        batches: The batches run.
    """
    loss: float                           # mean next-token cross-entropy, nats/token
    ppl: float
    tokens: int
    batches: int

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class StepOutput:
    """What `Trainer.train_step` returns.

    Attributes:
        step: Steps done, this one included.
        loss: The step's cross-entropy (before the aux loss).
        lr: The learning rate of the step.
        grad_norm: The gradient norm before clipping; None without clipping.
        aux_loss: The model's auxiliary loss (MoE load balancing).
        skipped: Why the batch was skipped (skip_nonfinite), else None.
    """
    step: int                             # steps done, this one included
    loss: float                           # the step's cross-entropy (before the aux loss)
    lr: float
    grad_norm: Optional[float]            # before clipping; None without clipping
    aux_loss: Optional[float]             # the model's auxiliary loss (MoE load balancing)
    skipped: Optional[str] = None         # why the batch was skipped (skip_nonfinite), else None


def _nonfinite_reason(loss: float, aux: Optional[float], grad_norm: float) -> Optional[str]:
    """Why a step must not update the weights (a non-finite loss or gradient), or None."""
    for what, v in (("the loss", loss), ("the auxiliary loss", aux), ("the gradient norm", grad_norm)):
        if v is not None and not math.isfinite(v):
            return f"{what} is {v}"
    return None


def _model_device(model: torch.nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def document_offsets(x: torch.Tensor, eos_id: int) -> torch.Tensor:
    """cu_seqlens (int64 [N+1]) of the rows of x [B, T] laid end to end: a document starts at every
    row start and at every eos token (which opens the next document, as it opens generation from
    an empty prompt), so the last token of a document still predicts the eos that ends it."""
    starts = x == eos_id
    starts[:, 0] = True
    idx = starts.reshape(-1).nonzero().squeeze(1)
    return torch.cat([idx, idx.new_tensor([x.numel()])])


def forward_logits(model: torch.nn.Module, x: torch.Tensor, eos_id: Optional[int] = None
                   ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(logits [B, T, V], aux loss or None) of x [B, T]; with eos_id, documents kept apart (the rows
    packed in one row with `document_offsets`)."""
    if eos_id is None:
        out = model(x)
        return out.logits, getattr(out, "aux_loss", None)
    out = model(x.reshape(1, -1), cu_seqlens=document_offsets(x, eos_id))
    return out.logits.reshape(*x.shape, -1), getattr(out, "aux_loss", None)


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: Union[PackedTokens, torch.Tensor], *, batch_size: int = 8,
             max_batches: Optional[int] = None, seq_len: Optional[int] = None,
             device: Optional[Union[str, torch.device]] = None, dtype: str = "float32",
             eos_id: Optional[int] = None, dist: Optional[Dist] = None) -> EvalResult:
    """Mean next-token cross-entropy (nats/token) and perplexity of `model` on `data`.

    With eos_id, documents are kept apart (`forward_logits`). With a `dist` of several processes, rank r
    evaluates rows r, r + N, ... of every batch and the sums are all-reduced (every rank runs one forward per
    batch, as FSDP needs). Deterministic; the model's train/eval mode is restored afterwards.

    Args:
        model: A causal LM (ids `[B, T]` -> logits).
        data: A PackedTokens (its windows in order) or a 1-D token tensor (cut into `seq_len` windows).
        batch_size: Windows per forward.
        max_batches: Evaluate at most this many batches (None: all).
        seq_len: The window length for a token tensor.
        device: Where to run (None: the model's device).
        dtype: The autocast dtype ("float32", "bfloat16", ...).
        eos_id: The <|endoftext|> id, to keep documents apart.
        dist: The processes of the run (None: one).

    Returns:
        An `EvalResult` (loss, ppl, tokens, batches).

    Examples:
        >>> import torch
        >>> from linattn import LanguageModel, LMConfig
        >>> from linattn.training import evaluate
        >>> model = LanguageModel(LMConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, mixer="gla"))
        >>> result = evaluate(model, torch.randint(0, 64, (400,)), seq_len=32, batch_size=4)
        >>> result.batches, result.tokens
        (3, 384)
    """
    if isinstance(data, torch.Tensor):
        if seq_len is None:
            raise TrainError("evaluate(tensor) needs seq_len")
        data = PackedTokens(data, seq_len, name="the evaluation data")
    device = torch.device(device) if device is not None else _model_device(model)
    rank, world = (dist.rank, dist.world_size) if dist is not None else (0, 1)
    was_training = model.training
    model.eval()
    total, count, nb = 0.0, 0, 0
    try:
        for x, y in data.eval_batches(batch_size, max_batches):
            weight = 1
            if world > 1:
                x, y = x[rank::world], y[rank::world]
                if x.shape[0] == 0:  # this rank has no row of the last batch: run one, count none
                    x, y, weight = x.new_zeros(1, y.shape[1]), y.new_zeros(1, y.shape[1]), 0
            x, y = x.to(device), y.to(device)
            with autocast(device, dtype):
                logits, _ = forward_logits(model, x, eos_id)
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")
            total += float(loss.item()) * weight
            count += y.numel() * weight
            nb += 1
    finally:
        model.train(was_training)
    if dist is not None and dist.active:
        total, count = dist.sum([total, count])
        count = int(round(count))
    if count == 0:
        raise CorpusError("no evaluation windows")
    mean = total / count
    return EvalResult(loss=mean, ppl=math.exp(min(mean, 700.0)), tokens=count, batches=nb)


class Trainer:
    """A model, its optimizer, and where training stands (step, tokens, logging-interval loss).

    `train` drives one; use it directly for a custom loop: `train_step(x, y)` per batch, `evaluate(data)`,
    `state_dict()` / `load_state_dict()` for checkpoints.

    Args:
        model: The model to train (moved to the device).
        config: The run's `TrainConfig` (optimizer, schedule, grad_accum, dtype, ...).
        device: Where to train (None: `config.device`).
        dist: the processes of the run (`Dist.from_env`); None is one process on `device`.
        eos_id: the tokenizer's <|endoftext|>, to keep documents apart when `config.doc_boundaries`
            (ignored for a model without `supports_cu_seqlens`).

    Examples:
        >>> import torch
        >>> from linattn import LanguageModel, LMConfig
        >>> from linattn.training import TrainConfig, Trainer
        >>> model = LanguageModel(LMConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, mixer="gla"))
        >>> trainer = Trainer(model, TrainConfig(steps=2, warmup=0, batch_size=2), device="cpu")
        >>> ids = torch.randint(0, 64, (2, 17))
        >>> out = trainer.train_step(ids[:, :-1], ids[:, 1:])
        >>> out.step, out.loss > 0
        (1, True)
    """

    def __init__(self, model: torch.nn.Module, config: TrainConfig,
                 device: Optional[Union[str, torch.device]] = None, *, dist: Optional[Dist] = None,
                 eos_id: Optional[int] = None):
        config.validate()
        self.config = config
        if dist is None:
            dist = Dist(device=torch.device(device) if device is not None else resolve_device(config.device))
        self.dist = dist
        self.device = torch.device(device) if device is not None else dist.device
        config.check_split(dist.world_size)
        self.model = model.to(self.device)
        if config.activation_checkpointing:
            if not hasattr(type(model), "activation_checkpointing"):
                raise TrainError(f"{type(model).__name__} does not support activation checkpointing")
            model.activation_checkpointing = True
        self.eos_id = eos_id if (config.doc_boundaries and getattr(model, "supports_cu_seqlens", False)) else None
        self.fsdp = dist.active and config.parallel == "fsdp"
        self.wrapped = self._wrap(self.model)
        if config.compile and self.eos_id is not None:
            warnings.warn("compile with doc_boundaries: the packed documents' offsets (cu_seqlens) change with "
                          "every batch and torch.compile recompiles for them; compile pays off with "
                          "doc_boundaries=False (--doc-boundaries false)", UserWarning, stacklevel=2)
        self._fwd = torch.compile(self.wrapped) if config.compile else self.wrapped
        self.optimizer = make_optimizer(self.model, config)
        self.step = 0                     # optimizer steps done
        self.tokens_seen = 0
        self.loss_sum, self.loss_count = 0.0, 0   # the current logging interval
        self.skipped = 0                  # steps whose batch was skipped (skip_nonfinite), whole run
        self._elapsed_before = 0.0       # training seconds of earlier sessions (from a checkpoint)
        self._clock: Optional[float] = None

    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        if not self.dist.active:
            return model
        if self.fsdp:
            from torch.distributed.fsdp import fully_shard

            for block in getattr(model, "blocks", []):
                fully_shard(block)
            return fully_shard(model)
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)

    def _sync(self, last: bool):
        """Gradient synchronisation on the last micro-batch of a step only."""
        if not self.dist.active:
            return contextlib.nullcontext()
        if self.fsdp:
            self.wrapped.set_requires_gradient_sync(last)
            return contextlib.nullcontext()
        return contextlib.nullcontext() if last else self.wrapped.no_sync()

    # -- the training step ----------------------------------------------------------------------
    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> StepOutput:
        """One optimizer step at the scheduled lr, in `grad_accum` micro-batches.

        Args:
            x: Inputs `[B, T]`: this process's share of the global batch (all of it in one process).
            y: Targets `[B, T]`.

        Returns:
            A `StepOutput` (step, loss, lr, grad_norm, aux_loss, skipped).

        Raises:
            TrainError: B does not split into grad_accum micro-batches.
            TrainingDiverged: A non-finite loss or gradient (unless `config.skip_nonfinite`).
        """
        cfg, dev = self.config, self.device
        n = cfg.grad_accum
        if x.shape[0] % n:
            raise TrainError(f"{x.shape[0]} windows do not split into grad_accum = {n} micro-batches")
        lr = lr_at(self.step, cfg)
        set_lr(self.optimizer, lr)
        x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float32, device=dev)
        aux_sum: Optional[torch.Tensor] = None
        # the operators' raising value checks are left out: a NaN surfaces as a non-finite loss naming the step
        with value_checks_suspended():
            for i, (xm, ym) in enumerate(zip(x.chunk(n), y.chunk(n))):
                with self._sync(i == n - 1):
                    with autocast(dev, cfg.dtype):
                        logits, aux = forward_logits(self._fwd, xm, self.eos_id)
                    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ym.reshape(-1))
                    total = loss + aux.float() if aux is not None else loss
                    (total / n).backward()
                loss_sum += loss.detach().float()
                if aux is not None:
                    aux_sum = aux.detach().float() if aux_sum is None else aux_sum + aux.detach().float()
        gnorm = self._clip_gradients()
        local = [float(loss_sum.item()) / n] + ([float(aux_sum.item()) / n] if aux_sum is not None else [])
        mean = [v / self.dist.world_size for v in self.dist.sum(local)]
        value, aux_mean = mean[0], (mean[1] if aux_sum is not None else None)
        reason = _nonfinite_reason(value, aux_mean, gnorm)
        if reason is not None:
            return self._nonfinite_step(reason, lr, x.numel() * self.dist.world_size)
        self.optimizer.step()
        self.step += 1
        self.tokens_seen += x.numel() * self.dist.world_size
        self.loss_sum += value
        self.loss_count += 1
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return StepOutput(step=self.step, loss=value, lr=lr, grad_norm=gnorm if cfg.grad_clip > 0 else None,
                          aux_loss=aux_mean)

    def _clip_gradients(self) -> float:
        """The total gradient norm (the same on every rank), the gradients clipped to grad_clip when > 0."""
        clip = self.config.grad_clip if self.config.grad_clip > 0 else float("inf")
        gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        if hasattr(gnorm, "full_tensor"):   # a DTensor under FSDP
            gnorm = gnorm.full_tensor()
        return float(gnorm)

    def _nonfinite_step(self, reason: str, lr: float, tokens: int) -> StepOutput:
        """A step whose loss or gradient is not finite: the weights are not updated. With skip_nonfinite
        (and finite weights) the batch is skipped and counted; else TrainingDiverged names the step."""
        step = self.step + 1
        self.optimizer.zero_grad(set_to_none=True)
        if not self.config.skip_nonfinite:
            raise TrainingDiverged(f"training diverged at step {step}: {reason} (lr {lr:.3g}); try a lower --lr, "
                                   f"or --skip-nonfinite true to skip such batches")
        if not self.weights_finite():
            raise TrainingDiverged(f"training diverged at step {step}: {reason} and the weights are not finite "
                                   f"(lr {lr:.3g}), so skipping batches cannot help; try a lower --lr")
        self.step = step
        self.skipped += 1
        self.tokens_seen += tokens
        return StepOutput(step=step, loss=float("nan"), lr=lr, grad_norm=None, aux_loss=None, skipped=reason)

    def weights_finite(self) -> bool:
        """Whether every parameter is finite on every rank (a collective with several processes)."""
        ok = all(bool(torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all())
                 for p in self.model.parameters())
        return self.dist.max([0.0 if ok else 1.0])[0] == 0.0

    def interval_loss(self) -> float:
        """Mean training loss since the last call (the logging interval), then reset."""
        mean = self.loss_sum / max(1, self.loss_count)
        self.loss_sum, self.loss_count = 0.0, 0
        return mean

    def evaluate(self, data: PackedTokens, max_batches: Optional[int] = None) -> EvalResult:
        """Validation loss on `data` with the run's batch size, dtype and `eval_batches`.

        The rows of every batch are shared among the processes, the sums all-reduced.

        Args:
            data: The packed validation tokens.
            max_batches: At most this many batches (None: `config.eval_batches`).

        Returns:
            An `EvalResult`.
        """
        cfg = self.config
        with value_checks_suspended():   # weights gone bad show as a NaN loss here too
            return evaluate(self.wrapped, data, batch_size=cfg.batch_size, device=self.device, dtype=cfg.dtype,
                            max_batches=cfg.eval_batches if max_batches is None else max_batches,
                            eos_id=self.eos_id, dist=self.dist)

    # -- time -------------------------------------------------------------------------------------
    def start_clock(self) -> None:
        self._clock = time.perf_counter()

    def elapsed_s(self) -> float:
        """Training wall time of the whole run: earlier sessions plus this one since start_clock()."""
        now = time.perf_counter() - self._clock if self._clock is not None else 0.0
        return self._elapsed_before + now

    # -- state ------------------------------------------------------------------------------------
    def model_state_dict(self) -> Optional[Dict[str, torch.Tensor]]:
        """The full weights: on every rank without FSDP; under FSDP gathered to rank 0.

        A collective under FSDP: every rank calls it; the others get None.

        Returns:
            {parameter name: tensor}, or None on the ranks other than 0 under FSDP.
        """
        if not self.fsdp:
            return self.model.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return sd if self.dist.is_main else None

    def _optimizer_state(self) -> Dict[str, Any]:
        if not self.fsdp:
            return self.optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def _param_names(self) -> List[str]:
        """The parameter names in the optimizer's order (index-keyed optimizer state)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        return [names[id(p)] for g in self.optimizer.param_groups for p in g["params"]]

    def _load_optimizer(self, sd: Dict[str, Any]) -> None:
        by_name = any(isinstance(k, str) for k in sd.get("state", {})) or any(
            isinstance(p, str) for g in sd.get("param_groups", []) for p in g.get("params", []))
        if not by_name and not self.fsdp:
            self.optimizer.load_state_dict(sd)
            return
        if not by_name:   # index-keyed (one process or DDP) into FSDP: name the entries
            order = self._param_names()
            sd = {"state": {order[int(k)]: v for k, v in sd["state"].items()},
                  "param_groups": [{**g, "params": [order[int(i)] for i in g["params"]]} for g in sd["param_groups"]]}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.optimizer, sd, options=StateDictOptions(full_state_dict=True))

    def state_dict(self) -> Dict[str, Any]:
        """The training state beside the weights (those are `model_state_dict()`, saved as safetensors).

        The optimizer state is full: index-keyed as torch writes it, or (FSDP) keyed by parameter name
        and gathered to rank 0. A collective under FSDP.

        Returns:
            The step, the optimizer state, the random states, the logging interval's loss, the tokens seen, the
            elapsed time and the world size (and the skipped batches), for `load_state_dict`.
        """
        return {"step": self.step, "optimizer": self._optimizer_state(), "torch_rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state_all() if self.device.type == "cuda" else None,
                "loss_acc": [self.loss_sum, self.loss_count], "tokens_seen": self.tokens_seen,
                "elapsed_s": self.elapsed_s(), "world_size": self.dist.world_size,
                **({"skipped": self.skipped} if self.skipped else {})}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue from `state_dict()`'s output: the next step is then exactly the saved run's next.

        The state may have been written by any number of processes, with or without FSDP.

        Args:
            state: What `state_dict()` returned (read back from a checkpoint).
        """
        try:
            self._load_optimizer(state["optimizer"])
        except (ValueError, KeyError, RuntimeError, IndexError) as e:
            raise CheckpointError(f"the optimizer state does not fit the model: {e}") from None
        self.step = int(state["step"])
        self.loss_sum, self.loss_count = (float(v) for v in state.get("loss_acc", [0.0, 0]))
        self.loss_count = int(self.loss_count)
        self.tokens_seen = int(state.get("tokens_seen", 0))
        self.skipped = int(state.get("skipped", 0))
        self._elapsed_before = float(state.get("elapsed_s", 0.0))
        torch.set_rng_state(state["torch_rng"])
        if state.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(list(state["cuda_rng"]))


def training_tokens_per_second(model_config, *, seq_len: int = 512, batch_size: int = 2, steps: int = 5,
                               warmup: int = 2, device: Optional[str] = None, dtype: str = "float32",
                               lr: float = 1e-4, seed: int = 0,
                               model_factory: Optional[Callable[[Any], torch.nn.Module]] = None,
                               return_all: bool = False, **options):
    """Median training tokens/s (`Trainer.train_step`: forward, backward, clip, AdamW) on random tokens.

    Runs `warmup` untimed steps, then `steps` timed ones.

    Args:
        model_config: A model-family config (or dict), or a built model.
        seq_len: Tokens per window.
        batch_size: Windows per step.
        steps: Timed steps.
        warmup: Untimed steps first.
        device: Where to run (None: auto).
        dtype: The autocast dtype.
        lr: The learning rate.
        seed: Seeds the model and the tokens.
        model_factory: model_factory(config) -> model, instead of the family's class.
        return_all: Return a dict instead of the median.
        **options: Further TrainConfig fields (grad_accum, activation_checkpointing, compile).

    Returns:
        The median tokens/s, or with return_all a dict with the per-step times, the parameter count and the median.
    """
    dev = resolve_device(device)
    torch.manual_seed(seed)
    if isinstance(model_config, torch.nn.Module):
        model = model_config
    else:
        model = (model_factory or build_model)(model_config)
    cfg = TrainConfig(lr=lr, min_lr_ratio=1.0, warmup=0, steps=warmup + steps, seq_len=seq_len,
                      batch_size=batch_size, dtype=dtype, seed=seed, **options)
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


__all__ = ["Trainer", "StepOutput", "EvalResult", "evaluate", "training_tokens_per_second", "forward_logits",
           "document_offsets"]
