"""`linattn vision ACTION ...`: train | eval | detect | export-onnx | synth.

    linattn vision train --data synthetic --out runs/yolo-lat --epochs 10 --neck hadamard_exp
    linattn vision train --data DIR --out runs/mine --epochs 50 --neck conv     # a YOLO-format folder
    linattn vision eval --checkpoint runs/yolo-lat [--data DIR|synthetic]        # mAP@0.5, mAP@0.5:0.95, per class
    linattn vision detect --checkpoint runs/yolo-lat img1.jpg img2.png --out detections/
    linattn vision export-onnx --checkpoint runs/yolo-lat --out yolo-lat.onnx
    linattn vision synth --out runs/synthetic-digits [--mnist DIR|glyphs]        # only build the synthetic set

Bad arguments, unusable data or an unreadable checkpoint print one line and exit with code 2; no
command overwrites a run or an output file unless given --overwrite.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from ..cli_support import ArgParser, UsageError, int_at_least
from ..errors import LinattnError

ACTIONS = ("train", "eval", "detect", "export-onnx", "synth")
DESCRIPTION = __doc__


def _fail(e: Exception) -> int:
    print(f"linattn vision: error: {' '.join(str(e).split())}", file=sys.stderr)
    return 2


# --------------------------------------------------------------------------- train

def add_train_arguments(p: argparse.ArgumentParser) -> None:
    from .model import NECKS
    from .train import VisionTrainConfig

    d = VisionTrainConfig()
    g = p.add_argument_group("data")
    g.add_argument("--data", default=None,
                   help="a YOLO-format folder, or 'synthetic' (default) for the MNIST-digit set")
    g.add_argument("--synthetic-dir", default=None,
                   help=f"where the synthetic set is built/reused (default {d.synthetic_dir})")
    g.add_argument("--mnist", default=None, help=f"MNIST idx folder for the synthetic set, or 'glyphs' for rendered "
                                                 f"digits (default {d.mnist})")
    g.add_argument("--synthetic-train", type=int, default=None,
                   help=f"synthetic training images (default {d.synthetic_train})")
    g.add_argument("--synthetic-val", type=int, default=None,
                   help=f"synthetic validation images (default {d.synthetic_val})")
    g.add_argument("--allow-unlabeled", action="store_true", help="images without a label file are backgrounds")
    g.add_argument("--val-fraction", type=float, default=None,
                   help="val share when the folder has no split (default 0.1)")
    g = p.add_argument_group("model")
    g.add_argument("--neck", default=None, choices=NECKS, metavar="NECK",
                   help="hadamard_exp (YOLO-LAT, default) | softmax | conv | any linattn feature map: "
                        + ", ".join(NECKS))
    g.add_argument("--width", type=int, default=None, help="neck width d (default 64)")
    g.add_argument("--heads", type=int, default=None, help="attention heads (default 4)")
    g.add_argument("--conv-depth", type=int, default=None, help="3x3 blocks of the conv neck (default 3)")
    g.add_argument("--image-size", type=int, default=None, help="input side, a multiple of 16 (default 320)")
    g = p.add_argument_group("optimization")
    g.add_argument("--epochs", type=int, default=None, help=f"default {d.epochs}")
    g.add_argument("--batch-size", type=int, default=None, help=f"default {d.batch_size}")
    g.add_argument("--lr", type=float, default=None, help=f"peak AdamW learning rate (default {d.lr})")
    g.add_argument("--min-lr-ratio", type=float, default=None, help=f"default {d.min_lr_ratio}")
    g.add_argument("--warmup", type=int, default=None, help=f"warmup steps (default {d.warmup})")
    g.add_argument("--weight-decay", type=float, default=None, help=f"default {d.weight_decay}")
    g.add_argument("--grad-clip", type=float, default=None, help=f"default {d.grad_clip}; 0 = off")
    g.add_argument("--seed", type=int, default=None, help=f"default {d.seed}")
    g.add_argument("--flip", type=float, default=None, help=f"horizontal flip probability (default {d.flip})")
    g.add_argument("--scale", type=float, default=None, help=f"scale jitter +- (default {d.scale})")
    g.add_argument("--brightness", type=float, default=None, help=f"brightness jitter +- (default {d.brightness})")
    g.add_argument("--box-weight", type=float, default=None, help=f"default {d.box_weight}")
    g.add_argument("--obj-weight", type=float, default=None, help=f"default {d.obj_weight}")
    g.add_argument("--cls-weight", type=float, default=None, help=f"default {d.cls_weight}")
    g = p.add_argument_group("run")
    g.add_argument("--out", default=None, help="run folder (default runs/vision)")
    g.add_argument("--resume", action="store_true", help="continue --out's latest checkpoint (fresh if none)")
    g.add_argument("--overwrite", action="store_true", help="start over in an --out that holds a run")
    g.add_argument("--eval-every", type=int, default=None, help="validate every N epochs (default 1; 0 = at the end)")
    g.add_argument("--eval-max-images", type=int, default=None, help="validate on at most N images")
    g.add_argument("--log-every", type=int, default=None, help=f"default {d.log_every}")
    g.add_argument("--keep-last", type=int, default=None, help=f"checkpoints kept (default {d.keep_last})")
    g.add_argument("--device", default=None, help="cpu | cuda (default cpu)")
    g.add_argument("--threads", type=int_at_least(1), default=None, help="torch CPU threads")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


_TRAIN_FLAGS = ("data", "synthetic_dir", "mnist", "synthetic_train", "synthetic_val", "val_fraction", "epochs",
                "batch_size", "lr", "min_lr_ratio", "warmup", "weight_decay", "grad_clip", "seed", "flip", "scale",
                "brightness", "box_weight", "obj_weight", "cls_weight", "eval_every", "eval_max_images", "log_every",
                "keep_last", "device", "threads")
_MODEL_FLAGS = ("neck", "width", "heads", "conv_depth", "image_size")


def train_main(args) -> int:
    import os

    from .. import checkpoint as ckpt_mod
    from .model import VisionConfig
    from .train import TRAJECTORY_FIELDS, VisionTrainConfig, VisionTrainError, train_detector

    out = Path(args.out or os.path.join("runs", "vision"))
    saved_train, saved_model = {}, None
    if args.resume and out.is_dir():
        ck = ckpt_mod.find_latest_checkpoint(out)
        if ck is not None:
            meta = ckpt_mod.read_checkpoint_config(ck)
            saved_train, saved_model = meta.get("train") or {}, meta.get("model")
    vals = VisionTrainConfig().to_dict()
    vals.update({k: v for k, v in saved_train.items() if k in vals})
    for k in _TRAIN_FLAGS:
        v = getattr(args, k, None)
        if v is not None:
            if k in TRAJECTORY_FIELDS and k in saved_train and saved_train[k] != v:
                raise VisionTrainError(f"config/checkpoint mismatch: --{k.replace('_', '-')} {v!r} but the checkpoint "
                                       f"was trained with {saved_train[k]!r}")
            vals[k] = v
    if args.allow_unlabeled:
        vals["allow_unlabeled"] = True
    for k in ("data", "synthetic_dir", "mnist"):
        v = vals.get(k)
        if v and v not in ("synthetic", "glyphs"):
            vals[k] = os.path.abspath(v)
    vals["out"] = str(out)
    vals["progress"] = False if args.no_progress else None
    cfg = VisionTrainConfig.from_dict(vals)
    if cfg.data != "synthetic" and not Path(cfg.data).exists():
        raise UsageError(f"--data {cfg.data}: no such folder (or pass --data synthetic)")
    model_cfg = None
    explicit = {k: getattr(args, k) for k in _MODEL_FLAGS if getattr(args, k, None) is not None}
    if saved_model is None:
        model_cfg = VisionConfig(**explicit).validate()
    else:
        for k, v in explicit.items():
            if saved_model.get(k) != v:
                raise VisionTrainError(f"config/checkpoint mismatch: --{k.replace('_', '-')} {v!r} but the checkpoint "
                                       f"has {saved_model.get(k)!r}")
    res = train_detector(cfg, model_cfg, resume=args.resume, overwrite=args.overwrite)
    if res.interrupted:
        print(f"[linattn vision] stopped at step {res.step}; checkpoint {res.checkpoint}; continue with --resume",
              file=sys.stderr)
        return 128 + int(res.signal) if res.signal else 0
    v = res.val or {}
    from .model import count_parameters

    print(json.dumps({"step": res.step, "epochs": res.epoch, "neck": res.config.neck,
                      "n_params": count_parameters(res.model), "val_map_50": v.get("map_50"),
                      "val_map": v.get("map"), "images_per_s": res.images_per_s,
                      "checkpoint": str(res.checkpoint) if res.checkpoint else None}))
    return 0


# --------------------------------------------------------------------------- eval

def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="run folder (its latest checkpoint) or a step folder")
    p.add_argument("--data", default=None, help="a YOLO-format folder or 'synthetic' (default: the checkpoint's data)")
    p.add_argument("--split", default="val", choices=("val", "train"), help="which split to evaluate (default val)")
    p.add_argument("--allow-unlabeled", action="store_true", help="images without a label file are backgrounds")
    p.add_argument("--batch-size", type=int, default=16, help="images per batch (default 16)")
    p.add_argument("--max-images", type=int, default=None, help="evaluate at most N images")
    p.add_argument("--conf-threshold", type=float, default=0.001, help="score threshold before NMS (default 0.001)")
    p.add_argument("--iou-threshold", type=float, default=0.6, help="NMS IoU threshold (default 0.6)")
    p.add_argument("--class-agnostic", action="store_true",
                   help="one class for every box (score = objectness): localisation alone")
    p.add_argument("--out", default=None, help="JSON file to write (default RUN/eval.json; a timestamped name "
                                               "if that exists)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--threads", type=int_at_least(1), default=None, help="torch CPU threads")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _data_of_checkpoint(ck, data: Optional[str], allow_unlabeled: bool):
    from .data import read_yolo_folder
    from .train import VisionTrainConfig, resolve_data

    tc = VisionTrainConfig.from_dict({**ck.train_config, "progress": False})
    if data is None or data == "synthetic":
        if data is None and tc.data != "synthetic":
            return read_yolo_folder(tc.data, allow_unlabeled=tc.allow_unlabeled, val_fraction=tc.val_fraction)
        return resolve_data(tc)
    if not Path(data).exists():
        raise UsageError(f"--data {data}: no such folder")
    return read_yolo_folder(data, allow_unlabeled=allow_unlabeled or tc.allow_unlabeled, val_fraction=tc.val_fraction)


def _free_path(path: Path, overwrite: bool) -> Path:
    if overwrite or not path.exists():
        return path
    stem = f"{path.stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    k = 0
    while True:
        cand = path.with_name(stem + (f"-{k}" if k else "") + path.suffix)
        if not cand.exists():
            return cand
        k += 1


def eval_main(args) -> int:
    import torch

    from ..io import write_json
    from .train import evaluate_detector, load_detector

    if args.threads:
        torch.set_num_threads(args.threads)
    ck = load_detector(args.checkpoint)
    folder = _data_of_checkpoint(ck, args.data, args.allow_unlabeled)
    items = folder.val if args.split == "val" else folder.train
    if not items:
        raise UsageError(f"{folder.root} has no {args.split} images")
    cfg = ck.model.config
    names = cfg.class_names or [str(i) for i in range(cfg.num_classes)]
    if folder.num_classes > cfg.num_classes:
        raise UsageError(f"the data has {folder.num_classes} classes, the model {cfg.num_classes}")
    res = evaluate_detector(ck.model, items, cfg.image_size, names, batch_size=args.batch_size,
                            conf_threshold=args.conf_threshold, iou_threshold=args.iou_threshold,
                            max_images=args.max_images, progress=not args.no_progress,
                            class_agnostic=args.class_agnostic)
    rec = {"checkpoint": str(ck.path), "step": ck.step, "data": str(folder.root), "split": args.split,
           "neck": cfg.neck, "image_size": cfg.image_size, "conf_threshold": args.conf_threshold,
           "iou_threshold": args.iou_threshold, "class_agnostic": args.class_agnostic, **res}
    run_dir = ck.path.parent if ck.path.name.startswith("step_") else ck.path
    out = _free_path(Path(args.out) if args.out else run_dir / "eval.json", args.overwrite)
    write_json(out, rec)
    print(f"mAP@0.5 {res['map_50']:.4f}  mAP@0.5:0.95 {res['map']:.4f}  ({res['images']} images, "
          f"{res['ground_truth']} objects, {res['detections']} detections; {ck.path})" if res["map"] is not None
          else f"no ground-truth objects in {res['images']} images")
    if res.get("per_class"):
        print("class      AP@0.5  AP@0.5:0.95  objects")
        for name, v in res["per_class"].items():
            print(f"{name:<10} {v['ap50']:.4f}  {v['ap']:.4f}       {v['n_gt']}")
    print(f"wrote {out}")
    return 0


# --------------------------------------------------------------------------- detect

def add_detect_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("images", nargs="+", metavar="IMAGE", help="image files")
    p.add_argument("--checkpoint", required=True, help="run folder or step folder")
    p.add_argument("--out", default="detections", help="folder for the annotated images + detections.json "
                                                       "(default detections/)")
    p.add_argument("--conf-threshold", type=float, default=0.25, help="default 0.25")
    p.add_argument("--iou-threshold", type=float, default=0.5, help="NMS IoU threshold (default 0.5)")
    p.add_argument("--overwrite", action="store_true", help="replace existing output files")
    p.add_argument("--threads", type=int_at_least(1), default=None, help="torch CPU threads")


def draw_detections(image, det, class_names: Sequence[str], path: Path) -> None:
    """Save `image` (uint8 [H, W, 3]) with boxes, class names and scores drawn."""
    from PIL import Image, ImageDraw

    im = Image.fromarray(image).convert("RGB")
    d = ImageDraw.Draw(im)
    palette = [(255, 56, 56), (255, 157, 151), (255, 112, 31), (255, 178, 29), (207, 210, 49), (72, 249, 10),
               (146, 204, 23), (61, 219, 134), (26, 147, 52), (0, 212, 187), (44, 153, 168), (0, 194, 255)]
    for b, s, c in zip(det["boxes"].tolist(), det["scores"].tolist(), det["labels"].tolist()):
        col = palette[int(c) % len(palette)]
        d.rectangle(b, outline=col, width=2)
        text = f"{class_names[int(c)] if int(c) < len(class_names) else c} {s:.2f}"
        tw = d.textlength(text)
        y = max(0, b[1] - 11)
        d.rectangle([b[0], y, b[0] + tw + 4, y + 11], fill=col)
        d.text((b[0] + 2, y), text, fill=(0, 0, 0))
    im.save(path)


def detect_main(args) -> int:
    import torch

    from ..io import write_json
    from .data import letterbox, load_image
    from .train import load_detector, predict

    if args.threads:
        torch.set_num_threads(args.threads)
    for f in args.images:
        if not Path(f).is_file():
            raise UsageError(f"image not found: {f}")
    ck = load_detector(args.checkpoint)
    cfg = ck.model.config
    names = cfg.class_names or [str(i) for i in range(cfg.num_classes)]
    out = Path(args.out)
    targets = [out / (Path(f).stem + ".png") for f in args.images]
    if len(set(targets)) != len(targets):
        raise UsageError("two input images have the same file name stem; their outputs would collide")
    clash = [str(t) for t in targets + [out / "detections.json"] if t.exists()]
    if clash and not args.overwrite:
        raise UsageError(f"{clash[0]} exists; pass --overwrite or another --out")
    out.mkdir(parents=True, exist_ok=True)
    ck.model.eval()
    record = []
    for f, target in zip(args.images, targets):
        img = load_image(f)
        x, _, lb = letterbox(img, torch.zeros(0, 5), cfg.image_size)
        det = predict(ck.model, x.unsqueeze(0), [lb], conf_threshold=args.conf_threshold,
                      iou_threshold=args.iou_threshold)[0]
        draw_detections(img, det, names, target)
        record.append({"image": str(f), "output": str(target),
                       "detections": [{"class": names[int(c)], "class_id": int(c), "score": float(s),
                                       "box_xyxy": [round(v, 2) for v in b]}
                                      for b, s, c in zip(det["boxes"].tolist(), det["scores"].tolist(),
                                                         det["labels"].tolist())]})
        print(f"{f}: {len(record[-1]['detections'])} detections -> {target}")
    write_json(out / "detections.json", {"checkpoint": str(ck.path), "conf_threshold": args.conf_threshold,
                                         "iou_threshold": args.iou_threshold, "images": record})
    return 0


# --------------------------------------------------------------------------- export-onnx

def add_export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="run folder or step folder")
    p.add_argument("--out", required=True, help="the .onnx file to write")
    p.add_argument("--image-size", type=int, default=None, help="input side (default: the model's)")
    p.add_argument("--no-check", action="store_true", help="skip the onnxruntime comparison")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")


def export_main(args) -> int:
    from .export import export_onnx
    from .train import load_detector

    out = Path(args.out)
    if out.exists() and not args.overwrite:
        raise UsageError(f"{out} exists; pass --overwrite or another --out")
    ck = load_detector(args.checkpoint)
    size = args.image_size or ck.model.config.image_size
    if size < 16 or size % 16:
        raise UsageError(f"--image-size must be a positive multiple of 16, got {size}")
    res = export_onnx(ck.model, out, size, check=not args.no_check)
    print(json.dumps(res))
    if not res["checked"]:
        print(f"[linattn vision] not checked against PyTorch: {res.get('check_skipped', '--no-check')}",
              file=sys.stderr)
    return 0


# --------------------------------------------------------------------------- synth

def add_synth_arguments(p: argparse.ArgumentParser) -> None:
    from .synthetic import SyntheticConfig

    d = SyntheticConfig()
    p.add_argument("--out", required=True, help="folder to write (YOLO format)")
    p.add_argument("--mnist", default="../shared/data/mnist", help="MNIST idx folder, or 'glyphs'")
    p.add_argument("--train", type=int, default=d.n_train, help=f"training images (default {d.n_train})")
    p.add_argument("--val", type=int, default=d.n_val, help=f"validation images (default {d.n_val})")
    p.add_argument("--size", type=int, default=d.size, help=f"canvas side (default {d.size})")
    p.add_argument("--seed", type=int, default=d.seed, help=f"random seed of the set (default {d.seed})")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")


def synth_main(args) -> int:
    from .synthetic import SyntheticConfig, build_synthetic

    if args.mnist != "glyphs" and not Path(args.mnist).is_dir():
        raise UsageError(f"--mnist {args.mnist}: no such folder (or pass --mnist glyphs)")
    t0 = time.perf_counter()
    root = build_synthetic(args.out, args.mnist, SyntheticConfig(n_train=args.train, n_val=args.val, size=args.size,
                                                                 seed=args.seed), overwrite=args.overwrite,
                           progress=True)
    print(f"synthetic set in {root} ({time.perf_counter() - t0:.1f} s)")
    return 0


# --------------------------------------------------------------------------- dispatch

_ACTIONS = {
    "train": (add_train_arguments, train_main, "train a YOLOLAT detector"),
    "eval": (add_eval_arguments, eval_main, "mAP@0.5, mAP@0.5:0.95 and per-class AP of a checkpoint"),
    "detect": (add_detect_arguments, detect_main, "draw a checkpoint's detections on images"),
    "export-onnx": (add_export_arguments, export_main, "export a checkpoint to ONNX (checked with onnxruntime)"),
    "synth": (add_synth_arguments, synth_main, "build the synthetic MNIST-digit detection set"),
}


def main(action: Optional[str], argv: Sequence[str] = ()) -> int:
    """Run `linattn vision ACTION argv...`; returns the exit code."""
    if action is None or action not in _ACTIONS:
        listing = ", ".join(ACTIONS)
        raise UsageError(f"which action? choose from: {listing}" if action is None
                         else f"unknown action {action!r}; choose from: {listing}", prog="linattn vision")
    add, run, desc = _ACTIONS[action]
    p = ArgParser(prog=f"linattn vision {action}", description=desc)
    add(p)
    args = p.parse_args(list(argv))
    try:
        rc = run(args)
    except UsageError:
        raise
    except LinattnError as e:
        return _fail(e)
    return 0 if rc is None else int(rc)


__all__ = ["ACTIONS", "DESCRIPTION", "main", "draw_detections"]
