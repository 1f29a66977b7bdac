"""YOLO-LAT: a small single-scale detector whose neck mixes the stride-16 grid with attention.

    model = YOLOLAT(num_classes=10, width=64, neck="hadamard_exp")   # ~0.2M parameters
    raw = model(images)              # [B, 5 + num_classes, H/16, W/16]: obj, tx, ty, tw, th, classes
    dets = model.detect(images)      # per image: boxes (xyxy, pixels of the input), scores, labels

Layout (as described for the ELA paper's public code, written here from that description):

* backbone to stride 16: stem Conv3x3(3 -> 16, stride 2), then depthwise-separable stages
  16 -> 32 (s2), 32 -> 64 (s2), 64 -> 2*width (s2) followed by a second 2*width -> 2*width stage
  (the "doubled" last stage); every conv is Conv + BatchNorm + SiLU;
* neck: 1x1 projection 2*width -> width, the selectable mixer on the H/16 x W/16 grid, 1x1 fusion
  back to 2*width, plus a residual from the backbone output;
* head: Conv3x3(2*width) + BN + SiLU, then a 1x1 conv to 5 + num_classes outputs per cell.

Necks (`neck=`): "hadamard_exp" (YOLO-LAT), any other name of `linattn.FEATURE_MAP_NAMES` (linear
attention with that map), "softmax" (softmax attention) or "conv" (a residual stack of
`conv_depth` 3x3 convolutions at width `width`: the local baseline with the same backbone and head).

The box parametrisation is documented in `linattn.vision.boxes.decode`.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn

from ..errors import ConfigError
from ..feature_maps import FEATURE_MAP_NAMES
from ..models.lm import count_parameters  # noqa: F401  (re-exported: one parameter count for every model)
from .layers import ConvBNAct, ConvStack2d, LinearAttention2d, SoftmaxAttention2d

STRIDE = 16
NECKS = ("hadamard_exp", "softmax", "conv") + tuple(n for n in FEATURE_MAP_NAMES if n != "hadamard_exp")


@dataclass
class VisionConfig:
    """Everything that defines a YOLOLAT's architecture (saved in checkpoints as a dict)."""
    num_classes: int = 10
    width: int = 64                 # d: neck width (the backbone ends at 2*width channels)
    neck: str = "hadamard_exp"
    heads: int = 4
    conv_depth: int = 3             # neck="conv": number of 3x3 blocks
    image_size: int = 320           # training/inference input side (the model itself takes any multiple of 16)
    class_names: Optional[List[str]] = None
    arch: str = "yololat"

    def validate(self) -> "VisionConfig":
        if not isinstance(self.num_classes, int) or self.num_classes < 1:
            raise ConfigError(f"num_classes must be a positive int, got {self.num_classes!r}")
        if not isinstance(self.width, int) or self.width < 4:
            raise ConfigError(f"width must be an int >= 4, got {self.width!r}")
        if self.neck not in NECKS:
            raise ConfigError(f"unknown neck {self.neck!r}; choose from {', '.join(NECKS)}")
        if not isinstance(self.heads, int) or self.heads < 1 or self.width % self.heads:
            raise ConfigError(f"heads must be a positive int dividing width ({self.width}), got {self.heads!r}")
        if not isinstance(self.conv_depth, int) or self.conv_depth < 1:
            raise ConfigError(f"conv_depth must be a positive int, got {self.conv_depth!r}")
        if not isinstance(self.image_size, int) or self.image_size < STRIDE or self.image_size % STRIDE:
            raise ConfigError(f"image_size must be a positive multiple of {STRIDE}, got {self.image_size!r}")
        if self.class_names is not None and len(self.class_names) != self.num_classes:
            raise ConfigError(f"{len(self.class_names)} class names for {self.num_classes} classes")
        if self.arch != "yololat":
            raise ConfigError(f"arch must be 'yololat', got {self.arch!r}")
        return self

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "VisionConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"unknown VisionConfig fields: {', '.join(unknown)}")
        return cls(**d).validate()


class DWSeparable(nn.Sequential):
    """Depthwise 3x3 (stride s) + pointwise 1x1, each Conv + BN + SiLU."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1):
        super().__init__(ConvBNAct(c_in, c_in, 3, stride, groups=c_in), ConvBNAct(c_in, c_out, 1))


def make_mixer(neck: str, width: int, heads: int = 4, conv_depth: int = 3) -> nn.Module:
    """The neck's mixer on a [B, width, H, W] map."""
    if neck == "softmax":
        return SoftmaxAttention2d(width, heads)
    if neck == "conv":
        return ConvStack2d(width, conv_depth)
    if neck in FEATURE_MAP_NAMES:
        return LinearAttention2d(width, heads, feature_map=neck)
    raise ConfigError(f"unknown neck {neck!r}; choose from {', '.join(NECKS)}")


class YOLOLAT(nn.Module):
    """The detector (see the module docstring). Output: raw per-cell predictions
    `[B, 5 + num_classes, H/16, W/16]`, channels (objectness, tx, ty, tw, th, class logits)."""

    stride = STRIDE

    def __init__(self, num_classes: int = 10, width: int = 64, neck: str = "hadamard_exp", heads: int = 4,
                 conv_depth: int = 3, image_size: int = 320, class_names: Optional[List[str]] = None):
        super().__init__()
        self.config = VisionConfig(num_classes=num_classes, width=width, neck=neck, heads=heads,
                                   conv_depth=conv_depth, image_size=image_size,
                                   class_names=list(class_names) if class_names is not None else None).validate()
        d = width
        self.num_classes = num_classes
        self.backbone = nn.Sequential(
            ConvBNAct(3, 16, 3, 2),          # /2
            DWSeparable(16, 32, 2),          # /4
            DWSeparable(32, 64, 2),          # /8
            DWSeparable(64, 2 * d, 2),       # /16
            DWSeparable(2 * d, 2 * d, 1),    # the doubled last stage
        )
        self.neck_proj = ConvBNAct(2 * d, d, 1)
        self.mixer = make_mixer(neck, d, heads, conv_depth)
        self.neck_fuse = ConvBNAct(d, 2 * d, 1)
        self.head = nn.Sequential(ConvBNAct(2 * d, 2 * d, 3), nn.Conv2d(2 * d, 5 + num_classes, 1))
        self._init_weights()

    @classmethod
    def from_config(cls, cfg) -> "YOLOLAT":
        if isinstance(cfg, dict):
            cfg = VisionConfig.from_dict(cfg)
        return cls(num_classes=cfg.num_classes, width=cfg.width, neck=cfg.neck, heads=cfg.heads,
                   conv_depth=cfg.conv_depth, image_size=cfg.image_size, class_names=cfg.class_names)

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        last = self.head[-1]
        nn.init.normal_(last.weight, std=0.01)
        with torch.no_grad():
            # priors: ~1% of cells hold an object; boxes ~15% of the image side (sigmoid(tw) = w)
            last.bias.zero_()
            last.bias[0] = math.log(0.01 / 0.99)
            last.bias[3:5] = math.log(0.15 / 0.85)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[1] != 3:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ConfigError(f"YOLOLAT expects images [B, 3, H, W], got {shape}")
        if x.shape[2] % STRIDE or x.shape[3] % STRIDE:
            raise ConfigError(f"image height and width must be multiples of {STRIDE}, got {tuple(x.shape[2:])}")
        f = self.backbone(x)
        f = f + self.neck_fuse(self.mixer(self.neck_proj(f)))
        return self.head(f)

    @torch.no_grad()
    def detect(self, images: torch.Tensor, conf_threshold: float = 0.25, iou_threshold: float = 0.5,
               max_det: int = 100) -> List[Dict[str, torch.Tensor]]:
        """Boxes (xyxy, pixels of `images`), scores and labels per image, after NMS."""
        from .boxes import postprocess

        was = self.training
        self.eval()
        try:
            raw = self(images)
        finally:
            self.train(was)
        return postprocess(raw, images.shape[-2:], conf_threshold=conf_threshold, iou_threshold=iou_threshold,
                           max_det=max_det)


__all__ = ["YOLOLAT", "VisionConfig", "NECKS", "STRIDE", "make_mixer", "count_parameters"]
