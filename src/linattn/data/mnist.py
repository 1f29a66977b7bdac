"""MNIST from the original idx files (gzip-compressed or not), with no torchvision.

    images, labels = load_mnist("shared/data/mnist", "train")   # uint8 [60000, 28, 28], int64 [60000]

The idx format (LeCun et al.): a big-endian header `0x00 0x00 <type> <ndim>`, then ndim
big-endian uint32 sizes, then the data in row-major order. Only the unsigned-byte type (0x08) is
used by MNIST; the signed/short/int/float/double types are read too.
"""
from __future__ import annotations

import gzip
import os
import struct
from pathlib import Path
from typing import Tuple, Union

import numpy as np
import torch

from ..errors import DataError

IDX_TYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
             0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}

FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


class MNISTError(DataError):
    """A missing or malformed MNIST file."""


def _open(path: Path):
    with open(path, "rb") as f:
        magic = f.read(2)
    return gzip.open(path, "rb") if magic == b"\x1f\x8b" else open(path, "rb")


def read_idx(path: Union[str, os.PathLike]) -> np.ndarray:
    """The array stored in an idx file (gzip-compressed or raw)."""
    path = Path(path)
    try:
        with _open(path) as f:
            data = f.read()
    except OSError as e:
        raise MNISTError(f"cannot read {path}: {e}") from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise MNISTError(f"{path} is not an idx file (bad magic number)")
    type_code, ndim = data[2], data[3]
    if type_code not in IDX_TYPES:
        raise MNISTError(f"{path}: unknown idx data type 0x{type_code:02x}")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise MNISTError(f"{path}: truncated header")
    shape = struct.unpack(">" + "I" * ndim, data[4:header])
    dtype = np.dtype(IDX_TYPES[type_code])
    count = int(np.prod(shape)) if ndim else 1
    if len(data) - header < count * dtype.itemsize:
        raise MNISTError(f"{path}: {len(data) - header} data bytes, expected {count * dtype.itemsize} "
                         f"for shape {shape}")
    arr = np.frombuffer(data, dtype=dtype, count=count, offset=header).reshape(shape)
    return arr.astype(dtype.newbyteorder("="), copy=True)


def _find(root: Path, stem: str) -> Path:
    """`stem` with or without .gz, also with the '.idx' spelling some mirrors use."""
    alt = stem.replace("-idx", ".idx")
    for name in (stem + ".gz", stem, alt + ".gz", alt):
        p = root / name
        if p.is_file():
            return p
    raise MNISTError(f"no {stem}[.gz] in {root} (expected the original MNIST idx files)")


def load_mnist(root: Union[str, os.PathLike], split: str = "train") -> Tuple[torch.Tensor, torch.Tensor]:
    """(images uint8 `[N, H, W]`, labels int64 `[N]`) of `split` ("train" or "test") from `root`."""
    if split not in FILES:
        raise MNISTError(f"split must be 'train' or 'test', got {split!r}")
    root = Path(root)
    if not root.is_dir():
        raise MNISTError(f"MNIST folder {root} does not exist")
    img_stem, lab_stem = FILES[split]
    images = read_idx(_find(root, img_stem))
    labels = read_idx(_find(root, lab_stem))
    if images.ndim != 3 or labels.ndim != 1 or images.shape[0] != labels.shape[0]:
        raise MNISTError(f"{root}: {split} images {images.shape} and labels {labels.shape} do not match")
    return torch.from_numpy(images.astype(np.uint8)), torch.from_numpy(labels.astype(np.int64))


def write_idx(path: Union[str, os.PathLike], array: np.ndarray, compress: bool = None) -> None:
    """Write `array` (uint8) as an idx file; gzip when the name ends in .gz (or compress=True)."""
    path = Path(path)
    arr = np.ascontiguousarray(array, dtype=np.uint8)
    payload = bytes([0, 0, 0x08, arr.ndim]) + struct.pack(">" + "I" * arr.ndim, *arr.shape) + arr.tobytes()
    if compress is None:
        compress = path.suffix == ".gz"
    with (gzip.open(path, "wb") if compress else open(path, "wb")) as f:
        f.write(payload)


__all__ = ["read_idx", "load_mnist", "write_idx", "MNISTError"]
