"""COCO-style mAP through pycocotools (the reference implementation of the COCO benchmark).

    m = MeanAP(class_names)
    m.update(pred_boxes, pred_scores, pred_labels, gt_boxes, gt_labels)     # per image, xyxy pixels
    m.compute()  # {"map_50", "map", "map_75", "per_class": {name: {"ap", "ap50", "n_gt"}}, ...}

"map" is mAP@0.5:0.95 (mean over IoU thresholds 0.50, 0.55, ..., 0.95 and over classes), "map_50"
mAP@0.5, both with COCO's 101-point interpolation, at most 100 detections per image, all areas.
Per-class AP is read from COCOeval's precision array (classes without ground truth are left out
of the means, as COCO does). torchmetrics' `MeanAveragePrecision` wraps the same code but needs
torchvision, which cannot be installed next to the CPU build of torch used here.
"""
from __future__ import annotations

import contextlib
import io
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from ..errors import LinattnError
from .boxes import VisionDependencyError


class MeanAP:
    def __init__(self, class_names: Optional[Sequence[str]] = None, num_classes: Optional[int] = None):
        if class_names is None and num_classes is None:
            raise LinattnError("MeanAP needs class_names or num_classes")
        self.class_names = list(class_names) if class_names is not None else [str(i) for i in range(num_classes)]
        self.images: List[Dict[str, Any]] = []
        self.gts: List[Dict[str, Any]] = []
        self.dets: List[Dict[str, Any]] = []

    def update(self, boxes: torch.Tensor, scores: torch.Tensor, labels: torch.Tensor, gt_boxes: torch.Tensor,
               gt_labels: torch.Tensor, width: int = 0, height: int = 0) -> None:
        """One image: predictions and ground truth, boxes xyxy in pixels."""
        img_id = len(self.images) + 1
        self.images.append({"id": img_id, "width": int(width), "height": int(height)})
        for b, c in zip(gt_boxes.tolist(), gt_labels.tolist()):
            w, h = b[2] - b[0], b[3] - b[1]
            self.gts.append({"id": len(self.gts) + 1, "image_id": img_id, "category_id": int(c) + 1,
                             "bbox": [b[0], b[1], w, h], "area": w * h, "iscrowd": 0})
        for b, s, c in zip(boxes.tolist(), scores.tolist(), labels.tolist()):
            self.dets.append({"image_id": img_id, "category_id": int(c) + 1,
                              "bbox": [b[0], b[1], b[2] - b[0], b[3] - b[1]], "score": float(s)})

    def compute(self) -> Dict[str, Any]:
        try:
            from pycocotools.coco import COCO
            from pycocotools.cocoeval import COCOeval
        except ImportError:
            raise VisionDependencyError("mAP needs pycocotools: pip install linattn[vision]") from None
        names = self.class_names
        n_gt = np.bincount([g["category_id"] - 1 for g in self.gts], minlength=len(names)) if self.gts \
            else np.zeros(len(names), int)
        base = {"images": len(self.images), "ground_truth": len(self.gts), "detections": len(self.dets)}
        if not self.gts:
            return {**base, "map": None, "map_50": None, "map_75": None, "per_class": {}}
        gt = COCO()
        gt.dataset = {"images": self.images, "annotations": self.gts,
                      "categories": [{"id": i + 1, "name": n} for i, n in enumerate(names)]}
        with contextlib.redirect_stdout(io.StringIO()):
            gt.createIndex()
        if not self.dets:
            per = {n: {"ap": 0.0, "ap50": 0.0, "n_gt": int(n_gt[i])} for i, n in enumerate(names) if n_gt[i] > 0}
            return {**base, "map": 0.0, "map_50": 0.0, "map_75": 0.0, "per_class": per}
        with contextlib.redirect_stdout(io.StringIO()):
            dt = gt.loadRes([dict(d) for d in self.dets])
            ev = COCOeval(gt, dt, iouType="bbox")
            ev.evaluate()
            ev.accumulate()
            ev.summarize()
        stats = ev.stats
        prec = ev.eval["precision"]            # [T (IoU), R (recall), K (class), A (area), M (max dets)]
        a_all, m_last = 0, len(ev.params.maxDets) - 1
        per = {}
        for k, cat in enumerate(ev.params.catIds):
            i = cat - 1
            if n_gt[i] == 0:
                continue
            p = prec[:, :, k, a_all, m_last]
            p50 = prec[0, :, k, a_all, m_last]
            per[names[i]] = {"ap": float(np.mean(p[p > -1])) if (p > -1).any() else 0.0,
                             "ap50": float(np.mean(p50[p50 > -1])) if (p50 > -1).any() else 0.0,
                             "n_gt": int(n_gt[i])}
        return {**base, "map": float(stats[0]), "map_50": float(stats[1]), "map_75": float(stats[2]),
                "map_small": float(stats[3]), "map_medium": float(stats[4]), "map_large": float(stats[5]),
                "per_class": per}


__all__ = ["MeanAP"]
