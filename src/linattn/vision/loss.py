"""The detection loss: objectness BCE + CIoU box loss + class cross-entropy.

Target assignment (YOLOv5's rule at a single scale): a ground-truth box with centre (cx, cy)
(normalised) is assigned to the cell holding its centre, (row floor(cy * H), column floor(cx * W))
of the H x W grid, and to the two neighbours nearest to the centre: the cell left or right of it
(whichever side of its cell the centre lies on) and the cell above or below it. Three positives
per object (fewer at the border) give the classifier and the box regressor three times the signal
of the one-cell rule; the box offsets reach [-0.5, 1.5] cells for that (`boxes.decode`), and NMS
removes the duplicates at inference. A cell claimed by several objects goes to the object whose
centre it holds, then to the smaller box. Matched cells are positives; all others are negatives.

    obj  = sum over all cells of BCE(obj logit, 1 if positive else 0) / max(1, number of positives)
    box  = mean over positives of 1 - CIoU(decoded box, ground truth)          (boxes.complete_box_iou_loss)
    cls  = mean over positives of cross-entropy(class logits, class)
    loss = w_obj * obj + w_box * box + w_cls * cls          (defaults 1, 2, 1)

Targets are `[N, 6]` rows (image index in the batch, class, cx, cy, w, h), boxes normalised to [0, 1].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from ..errors import LinattnError
from .boxes import complete_box_iou_loss, cxcywh_to_xyxy, decode


@dataclass
class LossWeights:
    obj: float = 1.0
    box: float = 2.0
    cls: float = 1.0


def assign_targets(targets: torch.Tensor, batch: int, H: int, W: int, neighbours: bool = True
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(flat indices b * H * W + row * W + col of the positive cells [P], rows of `targets` matched
    to them [P]). Each object takes its centre cell and, with `neighbours`, the horizontal and the
    vertical neighbour nearest to its centre (inside the grid). A cell claimed twice goes to an
    object whose centre it holds, then to the smaller box (then to the later row)."""
    if targets.numel() == 0:
        e = torch.zeros(0, dtype=torch.int64, device=targets.device)
        return e, e
    if targets.dim() != 2 or targets.shape[1] != 6:
        raise LinattnError(f"targets must be [N, 6] (image, class, cx, cy, w, h), got {tuple(targets.shape)}")
    b = targets[:, 0].long()
    if b.min() < 0 or b.max() >= batch:
        raise LinattnError(f"target image indices must be in [0, {batch}), got {b.min().item()}..{b.max().item()}")
    N = targets.shape[0]
    gx, gy = targets[:, 2] * W, targets[:, 3] * H
    col, row = gx.floor().long().clamp(0, W - 1), gy.floor().long().clamp(0, H - 1)
    tid = torch.arange(N, device=targets.device)
    cols, rows, tids, centre = [col], [row], [tid], [torch.ones(N, dtype=torch.bool, device=targets.device)]
    if neighbours:
        dx = torch.where(gx - col < 0.5, -1, 1)
        dy = torch.where(gy - row < 0.5, -1, 1)
        for c, r in ((col + dx, row), (col, row + dy)):
            ok = (c >= 0) & (c < W) & (r >= 0) & (r < H)
            cols.append(c[ok]), rows.append(r[ok]), tids.append(tid[ok])
            centre.append(torch.zeros(int(ok.sum()), dtype=torch.bool, device=targets.device))
    col, row, tid, centre = torch.cat(cols), torch.cat(rows), torch.cat(tids), torch.cat(centre)
    cell = b[tid] * (H * W) + row * W + col
    # priority of each claim: larger boxes first, then (stable) non-centre claims first, so the
    # highest rank in a cell is a centre claim of the smallest box. A scatter with reduce="amax"
    # is deterministic, unlike index_put with repeated indices.
    area = targets[tid, 4] * targets[tid, 5]
    order = torch.argsort(area, descending=True, stable=True)
    order = order[torch.argsort(centre[order].to(torch.int8), stable=True)]
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    best = torch.full((batch * H * W,), -1, dtype=torch.int64, device=targets.device)
    best.scatter_reduce_(0, cell, rank, reduce="amax", include_self=True)
    pos = torch.nonzero(best >= 0).squeeze(1)
    return pos, tid[order[best[pos]]]


def detection_loss(raw: torch.Tensor, targets: torch.Tensor, weights: Optional[LossWeights] = None
                   ) -> Tuple[torch.Tensor, Dict[str, float]]:
    """(total loss, {"obj", "box", "cls", "loss", "positives"}) for raw predictions [B, 5 + C, H, W]."""
    weights = weights or LossWeights()
    B, ch, H, W = raw.shape
    C = ch - 5
    T = H * W
    if targets.numel() and (targets[:, 1].min() < 0 or targets[:, 1].max() >= C):
        raise LinattnError(f"target classes must be in [0, {C}), got {targets[:, 1].min().item():g}.."
                           f"{targets[:, 1].max().item():g}")
    pos, tid = assign_targets(targets, B, H, W)
    flat = raw.float().flatten(2).transpose(1, 2).reshape(B * T, ch)          # [B*T, 5 + C]
    obj_t = torch.zeros(B * T, device=raw.device)
    obj_t[pos] = 1.0
    n_pos = int(pos.numel())
    obj = F.binary_cross_entropy_with_logits(flat[:, 0], obj_t, reduction="sum") / max(1, n_pos)
    if n_pos:
        boxes, _, _ = decode(raw)
        pb = boxes.reshape(B * T, 4)[pos]
        tb = targets[tid, 2:6].float()
        box = complete_box_iou_loss(cxcywh_to_xyxy(pb), cxcywh_to_xyxy(tb), reduction="mean")
        cls = F.cross_entropy(flat[pos, 5:], targets[tid, 1].long())
    else:
        box = flat[:, 1:5].sum() * 0.0
        cls = flat[:, 5:].sum() * 0.0
    total = weights.obj * obj + weights.box * box + weights.cls * cls
    parts = {"loss": float(total.detach()), "obj": float(obj.detach()), "box": float(box.detach()),
             "cls": float(cls.detach()), "positives": n_pos}
    return total, parts


__all__ = ["LossWeights", "assign_targets", "detection_loss"]
