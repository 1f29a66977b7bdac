"""Boxes: conversions, decoding of YOLOLAT's raw output, the CIoU loss, NMS and post-processing.

Box parametrisation (per cell (row i, column j) of an H x W grid; normalised image coordinates):

    cx = (j + 2 sigmoid(tx) - 0.5) / W      cy = (i + 2 sigmoid(ty) - 0.5) / H
                                    (the centre within half a cell around the cell: YOLOv5's range,
                                     so that a neighbouring cell can predict an object too)
    w  = sigmoid(tw)                h  = sigmoid(th)                (a fraction of the image side)
    score(class c) = sigmoid(obj) * softmax(class logits)_c

NMS and the CIoU loss come from libraries, never from a hand-written loop:

* torchvision's `ops.batched_nms` and `ops.complete_box_iou_loss` whenever torchvision imports and
  its compiled ops run here;
* otherwise (the case of the CPU build of torch 2.13 used by linattn's `make test`: the only
  torchvision 0.28 wheel on PyPI for Linux is built against CUDA torch, and cannot even be imported
  next to the CPU build) NMS is OpenCV's `cv2.dnn.NMSBoxesBatched`, and the CIoU loss is computed
  by `complete_box_iou_loss` below from the formula of Zheng et al. (AAAI 2020), written to give
  torchvision's values (same eps, alpha without gradient). `nms_backend()` says which is used.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import LinattnError


class VisionDependencyError(LinattnError):
    """An optional dependency of linattn.vision is missing (install `linattn[vision]`)."""


# --------------------------------------------------------------------------- conversions

def cxcywh_to_xyxy(b: torch.Tensor) -> torch.Tensor:
    cx, cy, w, h = b.unbind(-1)
    return torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], dim=-1)


def xyxy_to_cxcywh(b: torch.Tensor) -> torch.Tensor:
    x1, y1, x2, y2 = b.unbind(-1)
    return torch.stack([(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1], dim=-1)


def box_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pairwise IoU of xyxy boxes a [N, 4] and b [M, 4] -> [N, M]."""
    area_a = (a[:, 2] - a[:, 0]).clamp(min=0) * (a[:, 3] - a[:, 1]).clamp(min=0)
    area_b = (b[:, 2] - b[:, 0]).clamp(min=0) * (b[:, 3] - b[:, 1]).clamp(min=0)
    lt = torch.maximum(a[:, None, :2], b[None, :, :2])
    rb = torch.minimum(a[:, None, 2:], b[None, :, 2:])
    wh = (rb - lt).clamp(min=0)
    inter = wh[..., 0] * wh[..., 1]
    union = area_a[:, None] + area_b[None, :] - inter
    return inter / union.clamp(min=1e-12)


# --------------------------------------------------------------------------- the library backends

_TV = None          # torchvision.ops, or False when unusable; None: not looked up yet


def _torchvision_ops():
    global _TV
    if _TV is None:
        try:
            import torchvision.ops as tvo  # raises RuntimeError when its compiled ops do not match torch

            tvo.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)
            _TV = tvo
        except Exception:  # noqa: BLE001 - any failure means: not usable here
            _TV = False
    return _TV or None


def _cv2():
    try:
        import cv2
    except Exception:  # noqa: BLE001
        return None
    return cv2 if hasattr(cv2, "dnn") and hasattr(cv2.dnn, "NMSBoxesBatched") else None


def nms_backend() -> Optional[str]:
    """"torchvision", "opencv", or None when neither is usable."""
    if _torchvision_ops() is not None:
        return "torchvision"
    if _cv2() is not None:
        return "opencv"
    return None


def batched_nms(boxes: torch.Tensor, scores: torch.Tensor, labels: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """Class-aware NMS: indices of the kept boxes (xyxy [N, 4]), by decreasing score. A box is dropped
    when its IoU with a higher-scoring kept box of the same label exceeds `iou_threshold`."""
    if boxes.numel() == 0:
        return torch.zeros(0, dtype=torch.int64, device=boxes.device)
    tvo = _torchvision_ops()
    if tvo is not None:
        return tvo.batched_nms(boxes.float(), scores.float(), labels, float(iou_threshold))
    cv2 = _cv2()
    if cv2 is None:
        raise VisionDependencyError("NMS needs torchvision (with ops matching this torch) or OpenCV; "
                                    "install linattn[vision] (opencv-python-headless)")
    import numpy as np

    b = boxes.detach().double().cpu()
    xywh = torch.stack([b[:, 0], b[:, 1], b[:, 2] - b[:, 0], b[:, 3] - b[:, 1]], dim=1).numpy()
    s = scores.detach().float().cpu().numpy()
    keep = cv2.dnn.NMSBoxesBatched(xywh, s, labels.detach().cpu().numpy().astype(np.int32),
                                   float(-np.inf), float(iou_threshold))
    keep = torch.as_tensor(np.asarray(keep, dtype=np.int64).reshape(-1))
    keep = keep[torch.argsort(scores.detach().cpu()[keep], descending=True, stable=True)]
    return keep.to(boxes.device)


def nms(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """Class-agnostic NMS (see batched_nms)."""
    return batched_nms(boxes, scores, torch.zeros(boxes.shape[0], dtype=torch.int64, device=boxes.device),
                       iou_threshold)


def complete_box_iou_loss(boxes1: torch.Tensor, boxes2: torch.Tensor, reduction: str = "none",
                          eps: float = 1e-7) -> torch.Tensor:
    """1 - CIoU of matched xyxy boxes [..., 4] (torchvision's when usable).

    CIoU = IoU - rho^2 / c^2 - alpha * v, where rho is the distance between the centres, c the
    diagonal of the smallest enclosing box, v = 4/pi^2 (atan(w2/h2) - atan(w1/h1))^2 and
    alpha = v / (1 - IoU + v), treated as a constant (no gradient), as in the paper and torchvision.
    """
    tvo = _torchvision_ops()
    if tvo is not None:
        return tvo.complete_box_iou_loss(boxes1, boxes2, reduction=reduction, eps=eps)
    x1, y1, x2, y2 = boxes1.unbind(-1)
    x1g, y1g, x2g, y2g = boxes2.unbind(-1)
    xi1, yi1 = torch.max(x1, x1g), torch.max(y1, y1g)
    xi2, yi2 = torch.min(x2, x2g), torch.min(y2, y2g)
    inter = torch.zeros_like(x1)
    mask = (yi2 > yi1) & (xi2 > xi1)
    inter = torch.where(mask, (xi2 - xi1) * (yi2 - yi1), inter)
    union = (x2 - x1) * (y2 - y1) + (x2g - x1g) * (y2g - y1g) - inter + eps
    iou = inter / union
    xc1, yc1 = torch.min(x1, x1g), torch.min(y1, y1g)
    xc2, yc2 = torch.max(x2, x2g), torch.max(y2, y2g)
    diag = (xc2 - xc1) ** 2 + (yc2 - yc1) ** 2 + eps
    rho2 = ((x1 + x2 - x1g - x2g) / 2) ** 2 + ((y1 + y2 - y1g - y2g) / 2) ** 2
    w, h, wg, hg = x2 - x1, y2 - y1, x2g - x1g, y2g - y1g
    v = (4 / math.pi ** 2) * (torch.atan(wg / hg) - torch.atan(w / h)) ** 2
    with torch.no_grad():
        alpha = v / (1 - iou + v + eps)
    loss = 1 - iou + rho2 / diag + alpha * v
    if reduction == "mean":
        return loss.mean() if loss.numel() > 0 else 0.0 * loss.sum()
    if reduction == "sum":
        return loss.sum()
    if reduction != "none":
        raise LinattnError(f"reduction must be none, mean or sum, got {reduction!r}")
    return loss


# --------------------------------------------------------------------------- decoding

def grid_offsets(H: int, W: int, device=None, dtype=torch.float32) -> Tuple[torch.Tensor, torch.Tensor]:
    """(column, row) index of every cell, flattened row-major: two [H*W] tensors."""
    ys, xs = torch.meshgrid(torch.arange(H, device=device, dtype=dtype), torch.arange(W, device=device, dtype=dtype),
                            indexing="ij")
    return xs.reshape(-1), ys.reshape(-1)


def decode(raw: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw output [B, 5 + C, H, W] -> (boxes cxcywh normalised [B, H*W, 4], objectness probability
    [B, H*W], class probabilities [B, H*W, C]). Cells are flattened row-major."""
    if raw.dim() != 4 or raw.shape[1] < 6:
        raise LinattnError(f"raw predictions must be [B, 5 + num_classes, H, W], got {tuple(raw.shape)}")
    B, _, H, W = raw.shape
    p = raw.float().flatten(2).transpose(1, 2)               # [B, T, 5 + C]
    gx, gy = grid_offsets(H, W, raw.device)
    cx = (gx + 2 * torch.sigmoid(p[..., 1]) - 0.5) / W
    cy = (gy + 2 * torch.sigmoid(p[..., 2]) - 0.5) / H
    wh = torch.sigmoid(p[..., 3:5])
    boxes = torch.cat([cx.unsqueeze(-1), cy.unsqueeze(-1), wh], dim=-1)
    return boxes, torch.sigmoid(p[..., 0]), torch.softmax(p[..., 5:], dim=-1)


def postprocess(raw: torch.Tensor, image_hw: Sequence[int], *, conf_threshold: float = 0.25,
                iou_threshold: float = 0.5, max_det: int = 100, max_candidates: int = 3000,
                sizes: Optional[Sequence[Sequence[int]]] = None, class_agnostic: bool = False
                ) -> List[Dict[str, torch.Tensor]]:
    """Decode, keep cells whose score obj * max class probability exceeds `conf_threshold`, run
    class-aware NMS at `iou_threshold`, keep the best `max_det`.

    Boxes come back xyxy in pixels of `image_hw` (the network input, (H, W)); with `sizes` (one
    (H, W) per image) they are scaled to those sizes instead. Returns per image a dict with
    "boxes" [N, 4], "scores" [N], "labels" [N] (int64). class_agnostic: the score is the objectness
    alone, every label 0 and NMS across classes.
    """
    boxes, obj, cls = decode(raw)
    conf, labels = cls.max(dim=-1)
    scores = obj * conf
    if class_agnostic:
        scores, labels = obj, torch.zeros_like(labels)
    out = []
    for b in range(raw.shape[0]):
        hh, ww = (sizes[b] if sizes is not None else image_hw)
        s = scores[b]
        idx = torch.nonzero(s > conf_threshold).squeeze(1)
        if idx.numel() > max_candidates:
            idx = idx[torch.topk(s[idx], max_candidates).indices]
        bx = cxcywh_to_xyxy(boxes[b, idx]) * torch.tensor([ww, hh, ww, hh], dtype=torch.float32, device=raw.device)
        bx = torch.stack([bx[:, 0].clamp(0, ww), bx[:, 1].clamp(0, hh), bx[:, 2].clamp(0, ww),
                          bx[:, 3].clamp(0, hh)], 1)
        keep = batched_nms(bx, s[idx], labels[b, idx], iou_threshold)[:max_det]
        out.append({"boxes": bx[keep], "scores": s[idx][keep], "labels": labels[b, idx][keep]})
    return out


__all__ = ["VisionDependencyError", "cxcywh_to_xyxy", "xyxy_to_cxcywh", "box_iou", "nms_backend", "batched_nms",
           "nms", "complete_box_iou_loss", "grid_offsets", "decode", "postprocess"]
