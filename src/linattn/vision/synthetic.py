"""A deterministic synthetic detection set: digits pasted onto noisy canvases, in the YOLO format.

    root = build_synthetic("runs/synthetic-digits", mnist="../shared/data/mnist")   # once; reused after
    folder = read_yolo_folder(root)                                                 # the ordinary loader

Each image is a `size` x `size` RGB canvas: a random dark colour with a smooth gradient, blotches
and Gaussian pixel noise, and `min_digits`..`max_digits` digits pasted at random positions, each
scaled so that its 28 x 28 MNIST cell is `min_scale`..`max_scale` pixels, in a random bright
colour. A digit is placed only where its box overlaps earlier ones by IoU <= 0.1. The boxes are the
tight boxes of the pasted strokes (pixels with coverage >= 0.25), the classes the digits 0-9.
Training images take their digits from the MNIST training set, validation images from the MNIST
test set (digits never seen in training).

Without MNIST (`mnist=None` or "glyphs") the digits are rendered from Pillow's built-in font with
random rotation, shear and stroke width: weaker than MNIST, but available on every machine (the
tests use it).

Everything is drawn from numpy's PCG64 generator seeded by (seed, split, image index), so the set
is the same on every machine. `manifest.json` records the settings; a folder built with other
settings is refused, an identical one reused. The set is written into a temporary folder and
renamed into place, so an interrupted build leaves nothing half-written.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple, Union

import numpy as np
import torch

from ..errors import DataError
from ..io import TMP_PREFIX, read_json, write_json
from .data import write_yolo_item

FORMAT = "linattn-synthetic-digits/1"
PathLike = Union[str, os.PathLike]


@dataclass
class SyntheticConfig:
    n_train: int = 2000
    n_val: int = 300
    size: int = 320
    min_digits: int = 1
    max_digits: int = 6
    min_scale: int = 28
    max_scale: int = 96
    seed: int = 0
    source: str = "mnist"          # "mnist" or "glyphs"

    def validate(self) -> "SyntheticConfig":
        if self.n_train < 1 or self.n_val < 1:
            raise DataError("the synthetic set needs at least one training and one validation image")
        if not (16 <= self.size <= 4096):
            raise DataError(f"synthetic image size must be in [16, 4096], got {self.size}")
        if not (1 <= self.min_digits <= self.max_digits):
            raise DataError(f"need 1 <= min_digits <= max_digits, got {self.min_digits}, {self.max_digits}")
        if not (8 <= self.min_scale <= self.max_scale <= self.size):
            raise DataError(f"need 8 <= min_scale <= max_scale <= size, got {self.min_scale}, {self.max_scale}")
        if self.source not in ("mnist", "glyphs"):
            raise DataError(f"source must be 'mnist' or 'glyphs', got {self.source!r}")
        return self


# --------------------------------------------------------------------------- digit sources

def _glyph_bank(n_per_class: int, seed: int) -> Tuple[np.ndarray, np.ndarray]:
    """Digit images (uint8 [N, 28, 28], white on black) rendered from Pillow's default font."""
    from PIL import Image, ImageDraw, ImageFilter, ImageFont

    g = np.random.default_rng([seed, 977])
    imgs, labels = [], []
    for digit in range(10):
        for _ in range(n_per_class):
            try:
                font = ImageFont.load_default(size=int(g.integers(18, 26)))
            except TypeError:  # Pillow < 10.1: a fixed bitmap font
                font = ImageFont.load_default()
            im = Image.new("L", (40, 40), 0)
            d = ImageDraw.Draw(im)
            d.text((20, 20), str(digit), fill=255, font=font, anchor="mm")
            if g.uniform() < 0.5:
                im = im.filter(ImageFilter.MaxFilter(3))          # a bolder stroke
            shear = float(g.uniform(-0.3, 0.3))
            im = im.transform((40, 40), Image.AFFINE, (1, shear, -shear * 20, 0, 1, 0), resample=Image.BILINEAR)
            im = im.rotate(float(g.uniform(-15, 15)), resample=Image.BILINEAR)
            arr = np.asarray(im)
            ys, xs = np.nonzero(arr > 40)
            if len(xs) == 0:
                continue
            crop = arr[ys.min():ys.max() + 1, xs.min():xs.max() + 1]
            # fit into 20 x 20 and centre in 28 x 28, as MNIST does
            hh, ww = crop.shape
            s = 20.0 / max(hh, ww)
            crop = np.asarray(Image.fromarray(crop).resize((max(1, round(ww * s)), max(1, round(hh * s))),
                                                         Image.BILINEAR))
            cell = np.zeros((28, 28), np.uint8)
            y0, x0 = (28 - crop.shape[0]) // 2, (28 - crop.shape[1]) // 2
            cell[y0:y0 + crop.shape[0], x0:x0 + crop.shape[1]] = crop
            imgs.append(cell)
            labels.append(digit)
    return np.stack(imgs), np.asarray(labels, np.int64)


def _digit_source(cfg: SyntheticConfig, mnist: Optional[PathLike], split: str) -> Tuple[np.ndarray, np.ndarray]:
    if cfg.source == "glyphs":
        n = cfg.n_train if split == "train" else cfg.n_val
        return _glyph_bank(min(40, 2 + n), cfg.seed + (0 if split == "train" else 1))
    from ..data.mnist import load_mnist

    x, y = load_mnist(mnist, "train" if split == "train" else "test")
    return x.numpy(), y.numpy()


# --------------------------------------------------------------------------- one image

def _background(g: np.random.Generator, size: int) -> np.ndarray:
    base = g.uniform(0.0, 0.4, size=3)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    grad = (g.uniform(-0.15, 0.15) * xx + g.uniform(-0.15, 0.15) * yy)[..., None]
    img = np.broadcast_to(base, (size, size, 3)).astype(np.float32) + grad
    for _ in range(int(g.integers(0, 6))):   # soft blotches
        cx, cy, r = g.uniform(0, size), g.uniform(0, size), g.uniform(size / 20, size / 5)
        blob = np.exp(-(((xx * size - cx) ** 2 + (yy * size - cy) ** 2) / (2 * r * r)))[..., None]
        img = img + blob * g.uniform(-0.15, 0.15, size=3)
    img = img + g.normal(0.0, g.uniform(0.02, 0.08), size=img.shape)
    return img


def _iou(a, b) -> float:
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def render_image(cfg: SyntheticConfig, digits: np.ndarray, labels: np.ndarray, g: np.random.Generator
                 ) -> Tuple[np.ndarray, torch.Tensor]:
    """One canvas (uint8 [size, size, 3]) and its labels [N, 5] (class, cx, cy, w, h normalised)."""
    from PIL import Image

    S = cfg.size
    img = _background(g, S)
    boxes, rows = [], []
    for _ in range(int(g.integers(cfg.min_digits, cfg.max_digits + 1))):
        for _attempt in range(20):
            k = int(g.integers(0, len(digits)))
            side = int(g.integers(cfg.min_scale, cfg.max_scale + 1))
            aspect = float(g.uniform(0.85, 1.15))
            w, h = max(4, int(round(side * aspect))), side
            m = np.asarray(Image.fromarray(digits[k]).resize((w, h), Image.BILINEAR), np.float32) / 255.0
            ys, xs = np.nonzero(m >= 0.25)
            if len(xs) == 0:
                break
            x0, y0 = int(g.integers(0, S - w + 1)), int(g.integers(0, S - h + 1))
            box = (x0 + xs.min(), y0 + ys.min(), x0 + xs.max() + 1, y0 + ys.max() + 1)
            if any(_iou(box, b) > 0.1 for b in boxes):
                continue
            color = g.uniform(0.55, 1.0, size=3)
            a = m[..., None]
            img[y0:y0 + h, x0:x0 + w] = img[y0:y0 + h, x0:x0 + w] * (1 - a) + color * a
            boxes.append(box)
            bx0, by0, bx1, by1 = box
            rows.append([float(labels[k]), (bx0 + bx1) / 2 / S, (by0 + by1) / 2 / S, (bx1 - bx0) / S, (by1 - by0) / S])
            break
    out = (np.clip(img, 0.0, 1.0) * 255 + 0.5).astype(np.uint8)
    return out, torch.tensor(rows, dtype=torch.float32).reshape(-1, 5)


# --------------------------------------------------------------------------- the set

def _manifest(cfg: SyntheticConfig) -> Dict:
    return {"format": FORMAT, "config": asdict(cfg)}


def build_synthetic(root: PathLike, mnist: Optional[PathLike] = None, config: Optional[SyntheticConfig] = None,
                    *, overwrite: bool = False, progress: bool = False) -> Path:
    """Write the synthetic set to `root` (YOLO format: images/{train,val}, labels/{train,val},
    classes.txt, manifest.json) unless an identical one is already there. `mnist`: the MNIST idx
    folder, or None / "glyphs" for rendered digits. Returns `root`."""
    cfg = SyntheticConfig(**asdict(config)) if config is not None else SyntheticConfig()
    if mnist is None or str(mnist) == "glyphs":
        cfg.source = "glyphs"
    cfg.validate()
    root = Path(root)
    want = _manifest(cfg)
    if root.exists():
        have = read_json(root / "manifest.json")
        if have == want and (root / "images").is_dir():
            return root
        if not overwrite:
            what = "with other settings" if isinstance(have, dict) and have.get("format") == FORMAT else \
                "and is not a synthetic set built by linattn"
            raise DataError(f"{root} exists {what}; choose another folder or pass --overwrite")
    sources = {split: _digit_source(cfg, mnist, split) for split in ("train", "val")}
    tmp = root.parent / f"{TMP_PREFIX}{root.name}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.n_train + cfg.n_val, desc="synthetic set", unit="img", disable=not progress)
        for split, n in (("train", cfg.n_train), ("val", cfg.n_val)):
            digits, labels = sources[split]
            for i in range(n):
                g = np.random.default_rng([cfg.seed, 0 if split == "train" else 1, i])
                img, lab = render_image(cfg, digits, labels, g)
                write_yolo_item(tmp, split, f"{i:06d}", img, lab)
                bar.update(1)
        bar.close()
        (tmp / "classes.txt").write_text("".join(f"{d}\n" for d in range(10)), encoding="utf-8")
        write_json(tmp / "manifest.json", want)
        if root.exists():
            shutil.rmtree(root)
        root.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return root


__all__ = ["SyntheticConfig", "build_synthetic", "render_image", "FORMAT"]
