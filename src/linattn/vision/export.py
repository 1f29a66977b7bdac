"""ONNX export of a YOLOLAT detector, checked against PyTorch with onnxruntime when it is installed.

The exported graph takes `images` [B, 3, S, S] (float, RGB in [0, 1], letterboxed) and returns
`boxes` [B, (S/16)^2, 4] (xyxy, pixels of the input) and `scores` [B, (S/16)^2, num_classes]
(objectness x class probability): the decoding is inside the graph, NMS is not (run
`linattn.vision.boxes.batched_nms` or any NMS on the outputs). The batch dimension is dynamic; the
image side is fixed at export time.
"""
from __future__ import annotations

import contextlib
import io
import os
import warnings
from pathlib import Path
from typing import Any, Dict, Optional, Union

import torch
import torch.nn as nn

from ..errors import LinattnError
from .boxes import VisionDependencyError, cxcywh_to_xyxy, decode


class ExportError(LinattnError):
    """The ONNX export or its check failed."""


class DecodedDetector(nn.Module):
    """YOLOLAT + decoding: images -> (boxes xyxy pixels, per-class scores)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor):
        raw = self.model(images)
        boxes, obj, cls = decode(raw)
        H, W = images.shape[-2], images.shape[-1]
        scale = torch.tensor([W, H, W, H], dtype=boxes.dtype, device=boxes.device)
        return cxcywh_to_xyxy(boxes) * scale, obj.unsqueeze(-1) * cls


def _export(wrapper: nn.Module, x: torch.Tensor, path: Path, exporter: str, opset: Optional[int],
            verbose: bool) -> None:
    kw: Dict[str, Any] = dict(input_names=["images"], output_names=["boxes", "scores"])
    if opset is not None:
        kw["opset_version"] = opset
    sink = contextlib.nullcontext() if verbose else contextlib.redirect_stdout(io.StringIO())
    with sink, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "torchscript":
            torch.onnx.export(wrapper, (x,), str(path), dynamo=False,
                              dynamic_axes={"images": {0: "batch"}, "boxes": {0: "batch"}, "scores": {0: "batch"}},
                              **kw)
        else:
            try:
                import onnxscript  # noqa: F401
            except ImportError:
                raise VisionDependencyError("the dynamo ONNX exporter needs onnxscript") from None
            batch_dim = torch.export.Dim("batch", min=1, max=1024)
            torch.onnx.export(wrapper, (x,), str(path), dynamo=True, dynamic_shapes=({0: batch_dim},), **kw)


def _check(wrapper: nn.Module, path: Path, image_size: int) -> Dict[str, Any]:
    import onnxruntime as ort

    res: Dict[str, Any] = {"onnxruntime": ort.__version__}
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for b in (1, 2):
        xb = torch.rand(b, 3, image_size, image_size, generator=torch.Generator().manual_seed(b))
        with torch.no_grad():
            ref_boxes, ref_scores = wrapper(xb)
        got_boxes, got_scores = sess.run(None, {"images": xb.numpy()})
        if tuple(got_boxes.shape) != tuple(ref_boxes.shape) or tuple(got_scores.shape) != tuple(ref_scores.shape):
            raise ExportError(f"the ONNX model's output shapes differ from PyTorch's at batch {b}")
        db = float((torch.from_numpy(got_boxes) - ref_boxes).abs().max())
        ds = float((torch.from_numpy(got_scores) - ref_scores).abs().max())
        res[f"max_abs_diff_boxes_b{b}"], res[f"max_abs_diff_scores_b{b}"] = db, ds
        if not (db <= 1e-2 * image_size / 320 and ds <= 1e-3):
            raise ExportError(f"the ONNX model differs from PyTorch at batch {b}: boxes {db:.3g} px, scores {ds:.3g}")
    return res


def export_onnx(model: nn.Module, path: Union[str, os.PathLike], image_size: int = 320, *, check: bool = True,
                exporter: str = "auto", opset: Optional[int] = None, verbose: bool = False) -> Dict[str, Any]:
    """Export `model` to `path`; with `check` (and onnxruntime installed) compare the ONNX outputs
    with PyTorch's at batch 1 and 2. exporter: "torchscript" (torch.onnx's tracing exporter: fast),
    "dynamo" (torch.export based; needs onnxscript) or "auto" (torchscript, then dynamo if that
    fails or does not match PyTorch). Returns {"path", "bytes", "exporter", "checked", "max_abs_diff_*"}."""
    try:
        import onnx  # noqa: F401  (both exporters write through it)
    except ImportError:
        raise VisionDependencyError("ONNX export needs the onnx package (pip install onnx onnxruntime)") from None
    if exporter not in ("auto", "torchscript", "dynamo"):
        raise ExportError(f"exporter must be auto, torchscript or dynamo, got {exporter!r}")
    try:
        import onnxruntime  # noqa: F401
        can_check = check
    except ImportError:
        can_check = False
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    wrapper = DecodedDetector(model).eval()
    x = torch.rand(1, 3, image_size, image_size, generator=torch.Generator().manual_seed(0))
    tries = ["torchscript", "dynamo"] if exporter == "auto" else [exporter]
    errors = []
    for name in tries:
        try:
            _export(wrapper, x, path, name, opset, verbose)
            res: Dict[str, Any] = {"path": str(path), "bytes": path.stat().st_size, "exporter": name,
                                   "checked": False}
            if can_check:
                res.update(_check(wrapper, path, image_size))
                res["checked"] = True
            elif check:
                res["check_skipped"] = "onnxruntime is not installed"
            return res
        except VisionDependencyError as e:
            errors.append(f"{name}: {e}")
        except Exception as e:  # noqa: BLE001 - the exporters raise many types
            errors.append(f"{name}: {type(e).__name__}: {' '.join(str(e).split())[:300]}")
    raise ExportError("ONNX export failed (" + "; ".join(errors) + ")")


__all__ = ["ExportError", "DecodedDetector", "export_onnx"]
