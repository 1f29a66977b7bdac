"""Detection data in the YOLO folder format, with letterboxing, augmentation and batching.

Layouts read (the first that matches; "valid" is accepted for "val"):

    ROOT/images/train/*.jpg  ROOT/labels/train/*.txt   (and images/val, labels/val)   Ultralytics
    ROOT/train/images/*.jpg  ROOT/train/labels/*.txt   (and val/...)                 Roboflow export
    ROOT/images/*.jpg        ROOT/labels/*.txt         no split: `val_fraction` of the images,
                                                       chosen by a hash of the file name, is val

One label file per image (same stem), one object per line: `class cx cy w h`, the class an
integer >= 0 and the box normalised to [0, 1] by the image width and height. An empty label file
means an image without objects. Class names come from ROOT/classes.txt (one per line) or the
`names` of ROOT/data.yaml (when PyYAML is installed); otherwise classes are numbered.

Bad input raises `DataError` naming the file and line: a line without exactly 5 fields, a
non-integer or out-of-range class, a box outside [0, 1] (corners beyond a 1e-4 tolerance), a
non-positive size, an image that cannot be read, and an image without a label file (unless
`allow_unlabeled=True`: then it is a background image).

`DetectionDataset` letterboxes every image to `size` x `size` (aspect kept, grey padding) and, for
training, augments it: scale jitter (the letterboxed content scaled by U(1 - s, 1 + s) and placed
at a random offset, cropped where it exceeds the canvas), horizontal flip, brightness (all pixels
times U(1 - b, 1 + b)). The augmentation of image i in epoch e is a pure function of (seed, e, i),
so a resumed run sees the same batches as an uninterrupted one.
"""
from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from ..errors import DataError

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")
BOX_TOL = 1e-4
PAD_VALUE = 114 / 255.0
PathLike = Union[str, os.PathLike]


@dataclass
class Item:
    image: Path
    labels: torch.Tensor          # [N, 5] float32: class, cx, cy, w, h (normalised)


@dataclass
class YoloFolder:
    root: Path
    train: List[Item]
    val: List[Item]
    class_names: Optional[List[str]]
    layout: str

    @property
    def num_classes(self) -> int:
        if self.class_names is not None:
            return len(self.class_names)
        top = [int(it.labels[:, 0].max()) for it in self.train + self.val if it.labels.numel()]
        return max(top) + 1 if top else 1

    def fingerprint(self) -> str:
        """A hash of every file name and label of both splits (a resumed run checks it)."""
        h = hashlib.sha256()
        for split, items in (("train", self.train), ("val", self.val)):
            for it in items:
                h.update(f"{split}/{it.image.name}:".encode())
                h.update(np.ascontiguousarray(it.labels.numpy()).tobytes())
        return h.hexdigest()[:16]


# --------------------------------------------------------------------------- label files

def parse_label_file(path: PathLike, num_classes: Optional[int] = None) -> torch.Tensor:
    """The objects of one YOLO label file as a float32 [N, 5] tensor (class, cx, cy, w, h)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read label file {path}: {e}") from None
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields:
            continue
        where = f"{path}:{n}"
        if len(fields) != 5:
            extra = " (segmentation polygons are not supported)" if len(fields) > 5 else ""
            raise DataError(f"{where}: expected 5 fields 'class cx cy w h', got {len(fields)}{extra}: {line.strip()!r}")
        try:
            vals = [float(f) for f in fields]
        except ValueError:
            raise DataError(f"{where}: not a number in {line.strip()!r}") from None
        if not all(math.isfinite(v) for v in vals):
            raise DataError(f"{where}: non-finite value in {line.strip()!r}")
        c, cx, cy, w, h = vals
        if c < 0 or c != int(c):
            raise DataError(f"{where}: class must be an integer >= 0, got {fields[0]!r}")
        if num_classes is not None and c >= num_classes:
            raise DataError(f"{where}: class {int(c)} is out of range for {num_classes} classes")
        if w <= 0 or h <= 0:
            raise DataError(f"{where}: box width and height must be > 0, got w={w:g} h={h:g}")
        x0, y0, x1, y1 = cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2
        if min(x0, y0) < -BOX_TOL or max(x1, y1) > 1 + BOX_TOL:
            raise DataError(f"{where}: box (cx {cx:g}, cy {cy:g}, w {w:g}, h {h:g}) extends outside [0, 1]; "
                            f"YOLO labels are normalised by the image size")
        x0, y0, x1, y1 = max(0.0, x0), max(0.0, y0), min(1.0, x1), min(1.0, y1)
        rows.append([c, (x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0])
    return torch.tensor(rows, dtype=torch.float32).reshape(-1, 5)


def format_label_lines(labels: torch.Tensor) -> str:
    """YOLO label text for a [N, 5] tensor (class, cx, cy, w, h)."""
    return "".join(f"{int(r[0])} {r[1]:.6f} {r[2]:.6f} {r[3]:.6f} {r[4]:.6f}\n" for r in labels.tolist())


def _read_class_names(root: Path) -> Optional[List[str]]:
    f = root / "classes.txt"
    if f.is_file():
        names = [s.strip() for s in f.read_text(encoding="utf-8").splitlines() if s.strip()]
        if not names:
            raise DataError(f"{f} lists no class names")
        return names
    y = root / "data.yaml"
    if y.is_file():
        try:
            import yaml
        except ImportError:
            return None
        try:
            d = yaml.safe_load(y.read_text(encoding="utf-8"))
        except Exception as e:  # noqa: BLE001 - yaml's own error types
            raise DataError(f"cannot parse {y}: {e}") from None
        names = d.get("names") if isinstance(d, dict) else None
        if isinstance(names, dict):
            try:
                names = [str(names[k]) for k in sorted(names, key=int)]
            except (TypeError, ValueError):
                raise DataError(f"{y}: 'names' must map class ids to names") from None
        if isinstance(names, list) and names:
            return [str(n) for n in names]
    return None


def _list_images(folder: Path) -> List[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTS)


def _check_image(path: Path) -> None:
    from PIL import Image

    try:
        with Image.open(path) as im:
            im.verify()
    except Exception as e:  # noqa: BLE001 - PIL raises many types on bad files
        raise DataError(f"cannot read image {path}: {type(e).__name__}: {e}") from None


def _items(img_dir: Path, lab_dir: Path, num_classes: Optional[int], allow_unlabeled: bool,
           check_images: bool) -> List[Item]:
    out = []
    for img in _list_images(img_dir):
        lab = lab_dir / (img.stem + ".txt")
        if lab.is_file():
            labels = parse_label_file(lab, num_classes)
        elif allow_unlabeled:
            labels = torch.zeros(0, 5)
        else:
            raise DataError(f"image {img} has no label file {lab} (write an empty file for an image without "
                            f"objects, or pass --allow-unlabeled)")
        if check_images:
            _check_image(img)
        out.append(Item(img, labels))
    return out


def _in_val(name: str, val_fraction: float) -> bool:
    h = int(hashlib.sha256(name.encode()).hexdigest()[:8], 16)
    return h / 0xFFFFFFFF < val_fraction


def read_yolo_folder(root: PathLike, *, allow_unlabeled: bool = False, val_fraction: float = 0.1,
                     check_images: bool = True) -> YoloFolder:
    """Read and validate a YOLO-format folder (see the module docstring)."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"data folder not found: {root}")
    names = _read_class_names(root)
    nc = len(names) if names is not None else None

    def split_dir(kind: str, split: str) -> Optional[Path]:
        for s in ((split, "valid") if split == "val" else (split,)):
            for p in (root / kind / s, root / s / kind):
                if p.is_dir():
                    return p
        return None

    tr_img, va_img = split_dir("images", "train"), split_dir("images", "val")
    if tr_img is not None:
        tr_lab = tr_img.parent.parent / "labels" / tr_img.name if tr_img.parent.name == "images" \
            else tr_img.parent / "labels"
        train = _items(tr_img, tr_lab, nc, allow_unlabeled, check_images)
        val: List[Item] = []
        if va_img is not None:
            va_lab = va_img.parent.parent / "labels" / va_img.name if va_img.parent.name == "images" \
                else va_img.parent / "labels"
            val = _items(va_img, va_lab, nc, allow_unlabeled, check_images)
        layout = "split folders"
    elif (root / "images").is_dir():
        allitems = _items(root / "images", root / "labels", nc, allow_unlabeled, check_images)
        train = [it for it in allitems if not _in_val(it.image.name, val_fraction)]
        val = [it for it in allitems if _in_val(it.image.name, val_fraction)]
        layout = f"one folder, {val_fraction:g} of it held out as val"
    else:
        raise DataError(f"{root} is not a YOLO-format folder: expected images/ and labels/ (optionally with "
                        f"train/ and val/ subfolders), or train/images and train/labels")
    if not train:
        raise DataError(f"{root}: no training images found ({', '.join(IMAGE_EXTS)})")
    return YoloFolder(root=root, train=train, val=val, class_names=names, layout=layout)


def write_yolo_item(root: PathLike, split: str, stem: str, image: np.ndarray, labels: torch.Tensor) -> None:
    """Write one image (uint8 [H, W, 3]) as PNG and its label file into ROOT/images|labels/SPLIT/."""
    from PIL import Image

    root = Path(root)
    (root / "images" / split).mkdir(parents=True, exist_ok=True)
    (root / "labels" / split).mkdir(parents=True, exist_ok=True)
    Image.fromarray(image).save(root / "images" / split / f"{stem}.png", optimize=False, compress_level=1)
    (root / "labels" / split / f"{stem}.txt").write_text(format_label_lines(labels), encoding="utf-8")


# --------------------------------------------------------------------------- images

def load_image(path: PathLike) -> np.ndarray:
    """uint8 [H, W, 3] RGB."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            return np.asarray(im.convert("RGB"))
    except Exception as e:  # noqa: BLE001
        raise DataError(f"cannot read image {path}: {type(e).__name__}: {e}") from None


@dataclass
class Letterbox:
    """How an original image maps onto the square canvas: canvas = original * scale + (pad_x, pad_y)."""
    scale: float
    pad_x: float
    pad_y: float
    orig_w: int
    orig_h: int

    def to_original(self, boxes_xyxy: torch.Tensor) -> torch.Tensor:
        """Canvas-pixel xyxy boxes -> original-image pixels (clipped to the image)."""
        b = boxes_xyxy.clone()
        b[:, 0::2] = ((b[:, 0::2] - self.pad_x) / self.scale).clamp(0, self.orig_w)
        b[:, 1::2] = ((b[:, 1::2] - self.pad_y) / self.scale).clamp(0, self.orig_h)
        return b


def _resize(img: np.ndarray, w: int, h: int) -> np.ndarray:
    from PIL import Image

    if img.shape[1] == w and img.shape[0] == h:
        return img
    return np.asarray(Image.fromarray(img).resize((w, h), Image.BILINEAR))


def letterbox(img: np.ndarray, labels: torch.Tensor, size: int, *, scale_mul: float = 1.0,
              offset: Optional[Tuple[float, float]] = None, min_visible: float = 0.4
              ) -> Tuple[torch.Tensor, torch.Tensor, Letterbox]:
    """Fit `img` (uint8 [H, W, 3]) into a size x size canvas: scale to the longer side (times
    scale_mul), centre it (or place it at `offset`, fractions in [0, 1] of the free/overhanging
    room), crop what overhangs. Returns (float image [3, size, size] in [0, 1], labels normalised
    to the canvas (boxes clipped; those with less than `min_visible` of their area left dropped),
    the Letterbox)."""
    h0, w0 = img.shape[:2]
    r = size / max(h0, w0) * scale_mul
    nw, nh = max(1, int(round(w0 * r))), max(1, int(round(h0 * r)))
    fx, fy = offset if offset is not None else (0.5, 0.5)
    # room = size - n: positive -> padding to distribute, negative -> overhang to crop
    px, py = (size - nw) * fx, (size - nh) * fy
    px, py = float(int(round(px))), float(int(round(py)))
    canvas = np.full((size, size, 3), int(round(PAD_VALUE * 255)), dtype=np.uint8)
    res = _resize(img, nw, nh)
    # paste res at (px, py), cropped to the canvas
    x0, y0 = int(max(0, px)), int(max(0, py))
    x1, y1 = int(min(size, px + nw)), int(min(size, py + nh))
    if x1 > x0 and y1 > y0:
        canvas[y0:y1, x0:x1] = res[y0 - int(py):y1 - int(py), x0 - int(px):x1 - int(px)]
    t = torch.from_numpy(canvas).permute(2, 0, 1).float().div_(255.0)
    lb = Letterbox(scale=r, pad_x=px, pad_y=py, orig_w=w0, orig_h=h0)
    if labels.numel() == 0:
        return t, labels.reshape(0, 5).clone(), lb
    cls = labels[:, :1]
    cx, cy, w, h = (labels[:, 1] * w0, labels[:, 2] * h0, labels[:, 3] * w0, labels[:, 4] * h0)
    bx = torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], 1) * r
    bx[:, 0::2] += px
    bx[:, 1::2] += py
    area = (bx[:, 2] - bx[:, 0]) * (bx[:, 3] - bx[:, 1])
    cl = bx.clamp(0, size)
    area_c = (cl[:, 2] - cl[:, 0]).clamp(min=0) * (cl[:, 3] - cl[:, 1]).clamp(min=0)
    keep = (area_c >= min_visible * area) & (cl[:, 2] - cl[:, 0] >= 2) & (cl[:, 3] - cl[:, 1] >= 2)
    cl = cl[keep] / size
    out = torch.cat([cls[keep], (cl[:, :2] + cl[:, 2:]) / 2, cl[:, 2:] - cl[:, :2]], 1)
    return t, out, lb


@dataclass
class Augment:
    """Training augmentation; all off gives plain letterboxing."""
    flip: float = 0.5          # probability of a horizontal flip
    scale: float = 0.25        # scale jitter: content scaled by U(1 - scale, 1 + scale), placed at random
    brightness: float = 0.25   # pixels times U(1 - brightness, 1 + brightness)

    def enabled(self) -> bool:
        return self.flip > 0 or self.scale > 0 or self.brightness > 0


def _rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, int(epoch), int(index), 0x10_1A7])


class DetectionDataset:
    """Items of a split, letterboxed to `size` and (with `augment`) augmented per (seed, epoch, index)."""

    def __init__(self, items: Sequence[Item], size: int, augment: Optional[Augment] = None, seed: int = 0):
        if not items:
            raise DataError("the dataset has no images")
        self.items, self.size, self.augment, self.seed = list(items), int(size), augment, int(seed)

    def __len__(self) -> int:
        return len(self.items)

    def get(self, index: int, epoch: int = 0) -> Tuple[torch.Tensor, torch.Tensor, Letterbox]:
        it = self.items[index]
        img = load_image(it.image)
        a = self.augment
        if a is None or not a.enabled():
            return letterbox(img, it.labels, self.size)
        g = _rng(self.seed, epoch, index)
        mul = float(g.uniform(1 - a.scale, 1 + a.scale)) if a.scale > 0 else 1.0
        off = (float(g.uniform()), float(g.uniform())) if a.scale > 0 else None
        flip = a.flip > 0 and g.uniform() < a.flip
        bright = float(g.uniform(1 - a.brightness, 1 + a.brightness)) if a.brightness > 0 else 1.0
        t, lab, lb = letterbox(img, it.labels, self.size, scale_mul=mul, offset=off)
        if flip:
            t = t.flip(-1)
            lab[:, 1] = 1.0 - lab[:, 1]
        if bright != 1.0:
            t = (t * bright).clamp_(0.0, 1.0)
        return t, lab, lb


def collate(samples: Sequence[Tuple[torch.Tensor, torch.Tensor, Any]]) -> Tuple[torch.Tensor, torch.Tensor, List[Any]]:
    """(images [B, 3, S, S], targets [N, 6] with the image index first, the per-image metadata)."""
    imgs = torch.stack([s[0] for s in samples])
    tg = [torch.cat([torch.full((s[1].shape[0], 1), float(i)), s[1]], 1) for i, s in enumerate(samples)]
    return imgs, (torch.cat(tg) if tg else torch.zeros(0, 6)), [s[2] for s in samples]


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The shuffled image order of an epoch: a pure function of (seed, epoch)."""
    g = torch.Generator().manual_seed(int(seed) * 100_003 + int(epoch))
    return torch.randperm(n, generator=g)


def batches(ds: DetectionDataset, batch_size: int, *, epoch: int = 0, shuffle: bool = True, start: int = 0,
            drop_last: bool = True) -> Iterator[Tuple[torch.Tensor, torch.Tensor, List[Any], List[int]]]:
    """Batches (images, targets, letterboxes, indices) of one epoch, from batch number `start` on."""
    order = epoch_order(len(ds), ds.seed, epoch) if shuffle else torch.arange(len(ds))
    n_batches = len(ds) // batch_size if drop_last else math.ceil(len(ds) / batch_size)
    for b in range(start, n_batches):
        idx = order[b * batch_size:(b + 1) * batch_size].tolist()
        imgs, tg, meta = collate([ds.get(i, epoch) for i in idx])
        yield imgs, tg, meta, idx


def steps_per_epoch(n: int, batch_size: int) -> int:
    return n // batch_size


__all__ = ["Item", "YoloFolder", "parse_label_file", "format_label_lines", "read_yolo_folder", "write_yolo_item",
           "load_image", "Letterbox", "letterbox", "Augment", "DetectionDataset", "collate", "epoch_order",
           "batches", "steps_per_epoch", "IMAGE_EXTS"]
