"""Training and evaluation of YOLOLAT detectors (the Python API behind `linattn vision`).

    from linattn.vision.train import VisionTrainConfig, train_detector, evaluate_detector
    res = train_detector(VisionTrainConfig(data="synthetic", out="runs/yolo-lat", epochs=10),
                         VisionConfig(neck="hadamard_exp"))
    evaluate_detector(res.model, folder.val, 320, class_names)    # {"map_50", "map", "per_class", ...}

A run: reads a YOLO-format folder (`--data DIR`) or builds the synthetic digit set
(`--data synthetic`, see `linattn.vision.synthetic`) and reads it with the same loader; trains
with AdamW (weight decay on conv weights only), linear warmup then cosine decay to
`min_lr_ratio * lr`, gradient-norm clipping, the loss of `linattn.vision.loss`; validates (COCO
mAP through pycocotools) every `eval_every` epochs; writes `out/metrics.jsonl` and atomic
safetensors checkpoints (`linattn.checkpoint`: `step_N/` folders, `latest`) after every epoch.

Exact resume: the batch of step s is a pure function of (seed, s) (the epoch's shuffle and every
image's augmentation are seeded by (seed, epoch, index)); a checkpoint holds the weights and
BatchNorm statistics, the optimizer state and the step. `--resume` therefore reproduces the
uninterrupted run's weights (bitwise on CPU). SIGINT/SIGTERM finish the current step, save and
stop (exit code 128 + signal); an occupied `--out` is refused unless `--resume` or `--overwrite`.
"""
from __future__ import annotations

import dataclasses
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from .. import checkpoint as ckpt_mod
from ..errors import CheckpointError, ConfigError, DataError, LinattnError
from ..io import append_jsonl, read_jsonl, write_json, write_jsonl
from ..logs import get_logger
from ..signals import StopFlag
from .boxes import postprocess
from .data import Augment, DetectionDataset, Item, YoloFolder, batches, read_yolo_folder, steps_per_epoch
from .loss import LossWeights, detection_loss
from .metrics import MeanAP
from .model import YOLOLAT, VisionConfig, count_parameters

logger = get_logger("vision")
METRICS_FILE = "metrics.jsonl"
KIND = "vision-detector"
DEFAULT_SYNTHETIC_DIR = "runs/synthetic-digits"
DEFAULT_MNIST = "../shared/data/mnist"


class VisionTrainError(LinattnError):
    """A bad request to train (occupied output folder, mismatched resume, bad settings)."""


@dataclass
class VisionTrainConfig:
    data: str = "synthetic"                # a YOLO folder, or "synthetic"
    synthetic_dir: str = DEFAULT_SYNTHETIC_DIR
    mnist: Optional[str] = DEFAULT_MNIST   # digits of the synthetic set; None/"glyphs": rendered digits
    synthetic_train: int = 2000
    synthetic_val: int = 300
    out: Optional[str] = None
    epochs: int = 10
    batch_size: int = 16
    lr: float = 2e-3
    min_lr_ratio: float = 0.05
    warmup: int = 100                      # steps
    weight_decay: float = 5e-4
    grad_clip: float = 10.0
    seed: int = 0
    flip: float = 0.5
    scale: float = 0.25
    brightness: float = 0.25
    allow_unlabeled: bool = False
    val_fraction: float = 0.1
    box_weight: float = 2.0
    obj_weight: float = 1.0
    cls_weight: float = 1.0
    eval_every: int = 1                    # epochs; <= 0: only at the end
    eval_max_images: Optional[int] = None
    conf_threshold: float = 0.001          # for mAP
    iou_threshold: float = 0.6             # NMS for mAP
    log_every: int = 10
    keep_last: int = 2
    device: str = "cpu"
    threads: Optional[int] = None
    progress: Optional[bool] = None

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "VisionTrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


# fields that fix the trajectory: a resume must not change them
TRAJECTORY_FIELDS = ("batch_size", "lr", "min_lr_ratio", "warmup", "weight_decay", "grad_clip", "seed", "flip",
                     "scale", "brightness", "box_weight", "obj_weight", "cls_weight", "val_fraction")


@dataclass
class VisionTrainResult:
    step: int
    epoch: float
    model: YOLOLAT
    config: VisionConfig
    history: List[Dict[str, Any]] = field(default_factory=list)
    val: Optional[Dict[str, Any]] = None
    checkpoint: Optional[Path] = None
    interrupted: bool = False
    signal: Optional[int] = None
    images_per_s: Optional[float] = None
    elapsed_s: float = 0.0


# --------------------------------------------------------------------------- data

def resolve_data(cfg: VisionTrainConfig, progress: bool = False) -> YoloFolder:
    """The run's YOLO folder (building the synthetic set first for data='synthetic')."""
    if cfg.data == "synthetic":
        from .synthetic import SyntheticConfig, build_synthetic

        mnist = cfg.mnist
        if mnist not in (None, "glyphs") and not Path(mnist).is_dir():
            raise DataError(f"MNIST folder {mnist} not found (pass --mnist DIR with the idx files, or "
                            f"--mnist glyphs for rendered digits)")
        root = build_synthetic(cfg.synthetic_dir, mnist,
                               SyntheticConfig(n_train=cfg.synthetic_train, n_val=cfg.synthetic_val, seed=0),
                               progress=progress)
        return read_yolo_folder(root, check_images=False)
    return read_yolo_folder(cfg.data, allow_unlabeled=cfg.allow_unlabeled, val_fraction=cfg.val_fraction)


# --------------------------------------------------------------------------- evaluation

@torch.no_grad()
def predict(model: YOLOLAT, images: torch.Tensor, letterboxes: Sequence[Any], *, conf_threshold: float,
            iou_threshold: float, max_det: int = 100, class_agnostic: bool = False) -> List[Dict[str, torch.Tensor]]:
    """Detections per image, boxes in original-image pixels (class_agnostic: one class, label 0)."""
    raw = model(images)
    dets = postprocess(raw, images.shape[-2:], conf_threshold=conf_threshold, iou_threshold=iou_threshold,
                       max_det=max_det, class_agnostic=class_agnostic)
    for d, lb in zip(dets, letterboxes):
        d["boxes"] = lb.to_original(d["boxes"])
    return dets


def evaluate_detector(model: YOLOLAT, items: Sequence[Item], size: int, class_names: Sequence[str], *,
                      batch_size: int = 16, conf_threshold: float = 0.001, iou_threshold: float = 0.6,
                      max_images: Optional[int] = None, device: Optional[torch.device] = None,
                      progress: bool = False, class_agnostic: bool = False) -> Dict[str, Any]:
    """COCO mAP of `model` on `items` (mAP@0.5, mAP@0.5:0.95, per class); train/eval mode restored.
    class_agnostic: every box counts as one class "object" (NMS included), which measures
    localisation alone."""
    items = list(items)[:max_images] if max_images else list(items)
    if not items:
        raise DataError("no validation images to evaluate on")
    device = device or next(model.parameters()).device
    ds = DetectionDataset(items, size)
    metric = MeanAP(["object"] if class_agnostic else class_names)
    was = model.training
    model.eval()
    t0 = time.perf_counter()
    try:
        from tqdm.auto import tqdm

        for imgs, _, lbs, idx in tqdm(batches(ds, batch_size, shuffle=False, drop_last=False), desc="eval",
                                      total=math.ceil(len(ds) / batch_size), disable=not progress, leave=False):
            dets = predict(model, imgs.to(device), lbs, conf_threshold=conf_threshold, iou_threshold=iou_threshold,
                           class_agnostic=class_agnostic)
            for d, lb, i in zip(dets, lbs, idx):
                lab = items[i].labels.clone()
                if class_agnostic:
                    lab[:, 0] = 0
                W, H = lb.orig_w, lb.orig_h
                gt = torch.stack([(lab[:, 1] - lab[:, 3] / 2) * W, (lab[:, 2] - lab[:, 4] / 2) * H,
                                  (lab[:, 1] + lab[:, 3] / 2) * W, (lab[:, 2] + lab[:, 4] / 2) * H], 1)
                metric.update(d["boxes"].cpu(), d["scores"].cpu(), d["labels"].cpu(), gt, lab[:, 0].long(), W, H)
    finally:
        model.train(was)
    res = metric.compute()
    res["eval_s"] = time.perf_counter() - t0
    return res


# --------------------------------------------------------------------------- training helpers

def lr_at(step: int, cfg: VisionTrainConfig, total: int) -> float:
    if cfg.warmup > 0 and step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = min(1.0, max(0.0, (step - cfg.warmup) / max(1, total - cfg.warmup)))
    lo = cfg.lr * cfg.min_lr_ratio
    return lo + 0.5 * (cfg.lr - lo) * (1 + math.cos(math.pi * t))


def make_optimizer(model: torch.nn.Module, cfg: VisionTrainConfig) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": other, "weight_decay": 0.0}], lr=cfg.lr, foreach=False)


def check_out_dir(out: Path, resume: bool, overwrite: bool) -> Optional[Path]:
    """The checkpoint to resume, or None for a new run; refuses an occupied folder."""
    if out.exists() and not out.is_dir():
        raise VisionTrainError(f"--out {out} exists and is not a folder")
    latest = ckpt_mod.find_latest_checkpoint(out) if out.is_dir() else None
    if resume:
        if latest is None and (out / ckpt_mod.LATEST_FILE).exists():
            raise CheckpointError(f"{out} has a 'latest' pointer but no complete checkpoint to resume")
        return latest
    occupied = latest is not None or (out / ckpt_mod.LATEST_FILE).exists() or (out / METRICS_FILE).exists()
    if occupied and not overwrite:
        raise VisionTrainError(f"{out} already holds a run; pass --resume to continue it or --overwrite to start over")
    return None


def _clear_run(out: Path) -> None:
    import shutil

    for p in out.glob(ckpt_mod.STEP_PREFIX + "*"):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
    for name in (ckpt_mod.LATEST_FILE, METRICS_FILE, "summary.json"):
        if (out / name).exists():
            (out / name).unlink()


def load_detector(path, device: str = "cpu") -> ckpt_mod.Checkpoint:
    """A trained detector from a run folder or step folder (CheckpointError when it is not one)."""
    p = Path(path)
    ck = ckpt_mod.find_latest_checkpoint(p) if p.exists() else None
    if ck is not None:
        meta = ckpt_mod.read_checkpoint_config(ck)
        if meta.get("kind") != KIND:
            raise CheckpointError(f"{ck} is not a linattn vision checkpoint (it holds a language model?)")

    def factory(d):
        try:
            return YOLOLAT.from_config(d)
        except (ConfigError, TypeError) as e:
            raise CheckpointError(f"model config in {path} is not valid: {e}") from None

    return ckpt_mod.load_checkpoint(path, device=device, model_factory=factory)


# --------------------------------------------------------------------------- training

def train_detector(cfg: VisionTrainConfig, model_config: Optional[VisionConfig] = None, *, resume: bool = False,
                   overwrite: bool = False, folder: Optional[YoloFolder] = None, handle_signals: bool = True,
                   max_steps: Optional[int] = None) -> VisionTrainResult:
    """Train a detector (see the module docstring). `max_steps` stops early (tests, budgets) and saves."""
    for name in ("epochs", "batch_size", "log_every"):
        v = getattr(cfg, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise VisionTrainError(f"{name} must be a positive int, got {v!r}")
    if not cfg.lr > 0:
        raise VisionTrainError(f"lr must be positive, got {cfg.lr}")
    for name in ("flip",):
        if not 0 <= getattr(cfg, name) <= 1:
            raise VisionTrainError(f"{name} must be in [0, 1], got {getattr(cfg, name)}")
    for name in ("scale", "brightness"):
        if not 0 <= getattr(cfg, name) < 1:
            raise VisionTrainError(f"{name} must be in [0, 1), got {getattr(cfg, name)}")
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise VisionTrainError("device cuda requested but CUDA is not available")
    out = Path(cfg.out) if cfg.out else None
    resume_ck = check_out_dir(out, resume, overwrite) if out is not None else None
    if resume and out is None:
        raise VisionTrainError("resume needs an output folder")
    saved: Dict[str, Any] = {}
    if resume_ck is not None:
        saved = ckpt_mod.read_checkpoint_config(resume_ck)
        if saved.get("kind") != KIND:
            raise CheckpointError(f"{resume_ck} is not a linattn vision checkpoint")
        for k in TRAJECTORY_FIELDS:
            if k in saved.get("train", {}) and saved["train"][k] != getattr(cfg, k):
                raise VisionTrainError(f"config/checkpoint mismatch: {k} = {getattr(cfg, k)!r} but the checkpoint "
                                       f"was trained with {saved['train'][k]!r}")
        saved_model = VisionConfig.from_dict(saved["model"])
        if model_config is not None:
            for k, v in model_config.to_dict().items():
                if k not in ("class_names",) and v != getattr(saved_model, k):
                    raise VisionTrainError(f"config/checkpoint mismatch: model {k} = {v!r} but the checkpoint has "
                                           f"{getattr(saved_model, k)!r}")
        model_config = saved_model
    if model_config is None:
        model_config = VisionConfig()
    chatty = cfg.progress is not False
    if folder is None:
        t0 = time.perf_counter()
        folder = resolve_data(cfg, progress=bool(chatty))
        if chatty:
            logger.info(f"[linattn vision] data {folder.root} ({folder.layout}): {len(folder.train)} training, "
                     f"{len(folder.val)} validation images, {folder.num_classes} classes "
                     f"({time.perf_counter() - t0:.1f} s)")
    names = folder.class_names or [str(i) for i in range(folder.num_classes)]
    if resume_ck is None:
        model_config = dataclasses.replace(model_config, num_classes=len(names), class_names=list(names)).validate()
    elif model_config.num_classes != len(names):
        raise VisionTrainError(f"config/checkpoint mismatch: the data has {len(names)} classes, the checkpoint "
                               f"{model_config.num_classes}")
    fp = folder.fingerprint()
    if resume_ck is not None and saved.get("data_fingerprint") not in (None, fp):
        raise VisionTrainError("config/checkpoint mismatch: the data differs from the run's; pass the same --data")
    if len(folder.train) < cfg.batch_size:
        raise VisionTrainError(f"batch_size {cfg.batch_size} is larger than the {len(folder.train)} training images")

    size = model_config.image_size
    aug = Augment(flip=cfg.flip, scale=cfg.scale, brightness=cfg.brightness)
    ds = DetectionDataset(folder.train, size, aug, seed=cfg.seed)
    spe = steps_per_epoch(len(ds), cfg.batch_size)
    total = cfg.epochs * spe
    torch.manual_seed(cfg.seed)
    model = YOLOLAT.from_config(model_config).to(device)
    opt = make_optimizer(model, cfg)
    start, elapsed_before = 0, 0.0
    if resume_ck is not None:
        ckpt_mod.load_model_weights(model, resume_ck)
        model.to(device)
        state = ckpt_mod.load_training_state(resume_ck)
        try:
            opt.load_state_dict(state["optimizer"])
        except (ValueError, KeyError, RuntimeError) as e:
            raise CheckpointError(f"optimizer state in {resume_ck} does not fit the model: {e}") from None
        start = int(state["step"])
        elapsed_before = float(state.get("elapsed_s", 0.0))

    # everything that can fail on bad input has run: only now is the run folder touched
    history: List[Dict[str, Any]] = []
    metrics_path = None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        metrics_path = out / METRICS_FILE
        if resume_ck is not None:
            kept = [r for r in read_jsonl(metrics_path) if int(r.get("step", 0)) <= start]
            write_jsonl(metrics_path, kept)
            history = list(kept)
        else:
            _clear_run(out)
            metrics_path.touch()
    weights = LossWeights(obj=cfg.obj_weight, box=cfg.box_weight, cls=cfg.cls_weight)
    t_start = time.perf_counter()
    last_val: Optional[Dict[str, Any]] = None

    def log(rec: Dict[str, Any]) -> None:
        history.append(rec)
        if metrics_path is not None:
            append_jsonl(metrics_path, rec)

    def save(step_done: int) -> Optional[Path]:
        if out is None:
            return None
        state = {"step": step_done, "optimizer": opt.state_dict(),
                 "elapsed_s": elapsed_before + time.perf_counter() - t_start}
        return ckpt_mod.save_checkpoint(out, step_done, model, model_config=model_config.to_dict(),
                                        train_config=cfg.to_dict(), training_state=state,
                                        extra={"kind": KIND, "data_fingerprint": fp, "data_root": str(folder.root),
                                               "n_params": count_parameters(model), "epoch": step_done / spe,
                                               "val": last_val},
                                        keep_last=cfg.keep_last)

    def validate() -> Optional[Dict[str, Any]]:
        if not folder.val:
            return None
        return evaluate_detector(model, folder.val, size, names, batch_size=cfg.batch_size,
                                 conf_threshold=cfg.conf_threshold, iou_threshold=cfg.iou_threshold,
                                 max_images=cfg.eval_max_images, device=device)

    from tqdm.auto import tqdm

    if chatty:
        logger.info(f"[linattn vision] YOLOLAT neck={model_config.neck} width={model_config.width}: "
                 f"{count_parameters(model):,} parameters; {spe} steps/epoch x {cfg.epochs} epochs on {device}; "
                 + (f"resuming at step {start}" if resume_ck is not None else "new run")
                 + (f" in {out}" if out is not None else ""))
    echo = cfg.progress is None and not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty())
    bar = tqdm(total=total, initial=min(start, total), desc="train", unit="step", dynamic_ncols=True,
               disable=(None if cfg.progress is None else not cfg.progress))
    stop = StopFlag(handle_signals, notice="\n[linattn vision] {signal}: finishing the step, saving, exiting")
    step = start
    last_ckpt = resume_ck
    interrupted = stopping = False
    acc: Dict[str, float] = {}
    n_acc, t_int, img_int = 0, time.perf_counter(), 0
    step_times: List[float] = []
    model.train()
    try:
        with stop:
            while step < total and not stopping:
                epoch, b0 = divmod(step, spe)
                for imgs, targets, _, _ in batches(ds, cfg.batch_size, epoch=epoch, start=b0):
                    t0 = time.perf_counter()
                    for g in opt.param_groups:
                        g["lr"] = lr_at(step, cfg, total)
                    raw = model(imgs.to(device))
                    loss, parts = detection_loss(raw, targets.to(device), weights)
                    if not math.isfinite(parts["loss"]):
                        raise FloatingPointError(f"training loss is {parts['loss']} at step {step + 1}")
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    if cfg.grad_clip > 0:
                        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                    opt.step()
                    step += 1
                    step_times.append(time.perf_counter() - t0)
                    bar.update(1)
                    for k, v in parts.items():
                        acc[k] = acc.get(k, 0.0) + float(v)
                    n_acc += 1
                    img_int += imgs.shape[0]
                    end_epoch = step % spe == 0
                    last = step == total or (max_steps is not None and step >= max_steps)
                    if step % cfg.log_every == 0 or end_epoch or last:
                        now = time.perf_counter()
                        rec = {"step": step, "epoch": round(step / spe, 4), "lr": opt.param_groups[0]["lr"],
                               **{k: v / n_acc for k, v in acc.items()},
                               "images_per_s": img_int / max(1e-9, now - t_int),
                               "elapsed_s": elapsed_before + now - t_start}
                        ep = step // spe
                        if end_epoch and (cfg.eval_every > 0 and ep % cfg.eval_every == 0 or step == total):
                            last_val = validate()
                            if last_val is not None:
                                rec.update({"val_map_50": last_val["map_50"], "val_map": last_val["map"]})
                        log(rec)
                        msg = f"loss {rec['loss']:.3f} obj {rec['obj']:.3f} box {rec['box']:.3f} cls {rec['cls']:.3f}"
                        if "val_map_50" in rec:
                            msg += f" | val mAP@.5 {rec['val_map_50']:.3f} mAP {rec['val_map']:.3f}"
                        if echo and (end_epoch or last):
                            logger.info(f"step {step}/{total} (epoch {rec['epoch']:.2f}) {msg} "
                                     f"{rec['images_per_s']:.1f} img/s")
                        bar.set_postfix_str(msg)
                        acc, n_acc, t_int, img_int = {}, 0, time.perf_counter(), 0
                    stopping = stop.signum is not None or (max_steps is not None and step >= max_steps)
                    if end_epoch or step == total or stopping:
                        last_ckpt = save(step) or last_ckpt
                        t_int = time.perf_counter()
                    if stopping:
                        interrupted = step < total
                        break
    finally:
        bar.close()
    timed = step_times[1:] or step_times
    ips = cfg.batch_size * len(timed) / sum(timed) if timed and sum(timed) > 0 else None
    if out is not None and not interrupted:
        write_json(out / "summary.json", {"step": step, "epochs": step / spe, "n_params": count_parameters(model),
                                          "model": model_config.to_dict(), "train": cfg.to_dict(), "val": last_val,
                                          "images_per_s": ips,
                                          "elapsed_s": elapsed_before + time.perf_counter() - t_start,
                                          "checkpoint": str(last_ckpt) if last_ckpt else None})
    return VisionTrainResult(step=step, epoch=step / spe, model=model, config=model_config, history=history,
                             val=last_val, checkpoint=last_ckpt, interrupted=interrupted, signal=stop.signum,
                             images_per_s=ips, elapsed_s=time.perf_counter() - t_start)


__all__ = ["VisionTrainConfig", "VisionTrainResult", "VisionTrainError", "train_detector", "evaluate_detector",
           "predict", "load_detector", "resolve_data", "KIND"]
