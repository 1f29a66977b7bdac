"""linattn.vision: linear attention in an object detector (YOLO-LAT, ELA paper section VII).

    from linattn.vision import YOLOLAT, LinearAttention2d, SoftmaxAttention2d
    model = YOLOLAT(num_classes=10, width=64, neck="hadamard_exp")    # or "softmax", "conv", any feature map
    dets = model.detect(images)                                        # boxes, scores, labels per image

Modules: `layers` (2-D attention and conv mixers), `model` (YOLOLAT), `boxes` (decoding, CIoU,
NMS), `loss`, `data` (YOLO folders, augmentation), `synthetic` (the MNIST-digit set), `metrics`
(COCO mAP via pycocotools), `train` (training/evaluation), `export` (ONNX), `commands` (the
`linattn vision` command line). Optional dependencies (`pip install linattn[vision]`): pycocotools
for mAP, OpenCV for NMS where torchvision's compiled ops are unusable, onnx/onnxscript/onnxruntime
for the export.
"""
from .layers import ConvStack2d, LinearAttention2d, SoftmaxAttention2d
from .model import NECKS, YOLOLAT, VisionConfig, count_parameters

__all__ = ["LinearAttention2d", "SoftmaxAttention2d", "ConvStack2d", "YOLOLAT", "VisionConfig", "NECKS",
           "count_parameters"]
