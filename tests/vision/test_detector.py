"""linattn.vision: the YOLO-LAT detector, its data, loss, post-processing, metrics and commands.

Everything here is tiny (64 x 64 images, a handful of them) and needs no shared data: the
synthetic set is built from rendered glyphs. Tests needing an optional dependency skip cleanly
when it is absent (pycocotools for mAP, OpenCV or torchvision for NMS, onnx/onnxruntime).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from linattn.cli import main as cli_main
from linattn.errors import DataError, LinattnError
from linattn.vision import NECKS, YOLOLAT, ConvStack2d, LinearAttention2d, SoftmaxAttention2d
from linattn.vision.boxes import (
    batched_nms,
    box_iou,
    complete_box_iou_loss,
    cxcywh_to_xyxy,
    decode,
    nms_backend,
    postprocess,
)
from linattn.vision.data import (
    Augment,
    DetectionDataset,
    batches,
    format_label_lines,
    letterbox,
    parse_label_file,
    read_yolo_folder,
    write_yolo_item,
)
from linattn.vision.loss import assign_targets, detection_loss

needs_nms = pytest.mark.skipif(nms_backend() is None, reason="no NMS backend (torchvision ops or OpenCV)")


def _has(mod: str) -> bool:
    try:
        __import__(mod)
        return True
    except Exception:  # noqa: BLE001
        return False


needs_coco = pytest.mark.skipif(not _has("pycocotools"), reason="pycocotools not installed")


pytestmark = pytest.mark.usefixtures("one_thread_module")


@pytest.fixture(scope="module")
def glyph_set(tmp_path_factory):
    """A tiny synthetic set (rendered digits, 64 x 64), built once for the module."""
    from linattn.vision.synthetic import SyntheticConfig, build_synthetic

    root = tmp_path_factory.mktemp("vision") / "synth"
    cfg = SyntheticConfig(n_train=12, n_val=4, size=64, min_digits=1, max_digits=2, min_scale=20, max_scale=32)
    return build_synthetic(root, None, cfg)


# --------------------------------------------------------------------------- layers and model

@pytest.mark.parametrize("layer", ["linear", "softmax", "conv"])
def test_2d_layers_keep_the_shape(layer):
    x = torch.randn(2, 16, 5, 7)
    m = {"linear": lambda: LinearAttention2d(16, 4), "softmax": lambda: SoftmaxAttention2d(16, 4),
         "conv": lambda: ConvStack2d(16, 2)}[layer]()
    y = m(x)
    assert y.shape == x.shape and torch.isfinite(y).all()


def test_linear_attention_2d_is_the_operator_over_the_grid():
    """The layer's attention is linattn.linear_attention over the H*W cells (bidirectional: every
    cell sees every other, so moving one cell changes all outputs)."""
    from linattn import linear_attention

    torch.manual_seed(0)
    m = LinearAttention2d(8, 2).eval()
    x = torch.randn(1, 8, 3, 4)
    q, k, v = m.qkv(x).reshape(1, 3, 2, 4, 12).permute(1, 0, 4, 2, 3)
    s = 4 ** -0.5
    o, _ = linear_attention(q * s, k * s, v, feature_map="hadamard_exp", causal=False, mode="parallel")
    # the Hadamard Exp kernel, written out: w_ij = sum_d exp(q_id s) exp(k_jd s)
    w = torch.einsum("bihd,bjhd->bhij", torch.exp(q * s), torch.exp(k * s))
    ref = torch.einsum("bhij,bjhd->bihd", w / w.sum(-1, keepdim=True), v)
    torch.testing.assert_close(o, ref, rtol=1e-5, atol=1e-5)
    got = m.attend(q, k, v)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    x2 = x.clone()
    x2[..., 0, 0] += 1.0
    assert (m(x2) - m(x))[..., 2, 3].abs().max() > 0


def test_hadamard_exp_layer_survives_large_activations():
    m = LinearAttention2d(8, 2, qk_scale=1.0).eval()
    with torch.no_grad():
        m.qkv.weight.mul_(300.0)  # q, k of order 100s: exp() alone would overflow fp32
    y = m(torch.randn(1, 8, 4, 4))
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("neck", ["hadamard_exp", "softmax", "conv", "elu+1", "favor+"])
def test_yololat_output_shape(neck):
    m = YOLOLAT(num_classes=3, width=16, neck=neck, heads=2)
    y = m(torch.rand(2, 3, 64, 96))
    assert y.shape == (2, 8, 4, 6)


def test_yololat_default_size_and_necks():
    n = sum(p.numel() for p in YOLOLAT(num_classes=1, width=64).parameters())
    assert 150_000 < n < 250_000  # "~200k parameters" of the paper's code
    assert {"hadamard_exp", "softmax", "conv"} <= set(NECKS)
    lin = sum(p.numel() for p in YOLOLAT(10, 64, "hadamard_exp").parameters())
    conv = sum(p.numel() for p in YOLOLAT(10, 64, "conv").parameters())
    assert conv > lin


def test_yololat_bad_config_and_input():
    with pytest.raises(LinattnError, match="unknown neck"):
        YOLOLAT(neck="nope")
    with pytest.raises(LinattnError, match="heads"):
        YOLOLAT(width=30, heads=4)
    with pytest.raises(LinattnError, match="multiples of 16"):
        YOLOLAT(width=16)(torch.rand(1, 3, 50, 64))
    with pytest.raises(LinattnError, match=r"\[B, 3, H, W\]"):
        YOLOLAT(width=16)(torch.rand(3, 64, 64))


# --------------------------------------------------------------------------- boxes, NMS, CIoU

def _raw_with(cells, C=3, H=4, W=4):
    """Raw predictions with confident objects at `cells` = [(row, col, class, (cx, cy, w, h))]."""
    raw = torch.full((1, 5 + C, H, W), -10.0)
    raw[:, 5:] = 0.0
    logit = lambda p: math.log(p / (1 - p))  # noqa: E731
    for r, c, cls, (cx, cy, w, h) in cells:
        raw[0, 0, r, c] = 10.0
        raw[0, 1, r, c] = logit((cx * W - c + 0.5) / 2)
        raw[0, 2, r, c] = logit((cy * H - r + 0.5) / 2)
        raw[0, 3, r, c] = logit(w)
        raw[0, 4, r, c] = logit(h)
        raw[0, 5 + cls, r, c] = 10.0
    return raw


def test_decode_inverts_the_parametrisation():
    raw = _raw_with([(1, 2, 0, (0.6, 0.3, 0.2, 0.1))])
    boxes, obj, cls = decode(raw)
    i = 1 * 4 + 2
    torch.testing.assert_close(boxes[0, i], torch.tensor([0.6, 0.3, 0.2, 0.1]), rtol=1e-4, atol=1e-5)
    assert obj[0, i] > 0.99 and obj[0, 0] < 1e-4 and cls[0, i].argmax() == 0


@needs_nms
def test_postprocess_decodes_thresholds_and_suppresses():
    # two overlapping boxes of class 1 (IoU 0.64: the lower-scoring one goes), a class-2 box on top
    # of them (kept: another class), a far class-1 box (kept)
    raw = _raw_with([(1, 1, 1, (0.40, 0.40, 0.50, 0.50)), (1, 2, 1, (0.51, 0.40, 0.50, 0.50)),
                     (2, 1, 2, (0.40, 0.51, 0.50, 0.50)), (3, 3, 1, (0.90, 0.90, 0.10, 0.10))])
    raw[0, 0, 1, 2] = 3.0                       # the second box scores lower (sigmoid(3) = 0.95)
    det = postprocess(raw, (64, 64), conf_threshold=0.25, iou_threshold=0.5)[0]
    assert sorted(det["labels"].tolist()) == [1, 1, 2]
    expect = {(1, (9.6, 9.6, 41.6, 41.6)), (2, (9.6, 16.64, 41.6, 48.64)), (1, (54.4, 54.4, 60.8, 60.8))}
    for lab, ref in expect:
        assert any(lbl == lab and all(abs(a - b) < 0.05 for a, b in zip(box, ref))
                   for lbl, box in zip(det["labels"].tolist(), det["boxes"].tolist())), (lab, ref, det)
    assert all(s >= 0.25 for s in det["scores"].tolist())
    assert det["scores"].tolist() == sorted(det["scores"].tolist(), reverse=True)
    # with a looser NMS both overlapping class-1 boxes stay; above every score nothing does
    assert len(postprocess(raw, (64, 64), conf_threshold=0.25, iou_threshold=0.7)[0]["boxes"]) == 4
    assert len(postprocess(raw, (64, 64), conf_threshold=0.9999999)[0]["boxes"]) == 0
    # class-agnostic: one class, NMS across classes (the class-2 box overlaps the first one by IoU 0.64)
    agn = postprocess(raw, (64, 64), conf_threshold=0.25, iou_threshold=0.5, class_agnostic=True)[0]
    assert len(agn["boxes"]) == 2 and agn["labels"].tolist() == [0, 0]


@needs_nms
def test_batched_nms_matches_the_definition():
    g = torch.Generator().manual_seed(0)
    xy = torch.rand(60, 2, generator=g) * 50
    boxes = torch.cat([xy, xy + 5 + torch.rand(60, 2, generator=g) * 20], 1)
    scores = torch.rand(60, generator=g)
    labels = torch.randint(0, 3, (60,), generator=g)
    keep = batched_nms(boxes, scores, labels, 0.4)
    # the greedy definition: a box survives iff no higher-scoring surviving box of its class overlaps > 0.4
    order = torch.argsort(scores, descending=True).tolist()
    iou = box_iou(boxes, boxes)
    ref = []
    for i in order:
        if all(not (labels[j] == labels[i] and iou[i, j] > 0.4) for j in ref):
            ref.append(i)
    assert keep.tolist() == ref


def test_ciou_loss_values():
    a = torch.tensor([[0.0, 0.0, 10.0, 10.0]])
    assert complete_box_iou_loss(a, a).item() == pytest.approx(0.0, abs=1e-6)
    b = torch.tensor([[5.0, 0.0, 15.0, 10.0]])    # IoU 1/3, centres 5 apart, enclosing diagonal^2 = 15^2 + 10^2
    assert complete_box_iou_loss(a, b).item() == pytest.approx(1 - 1 / 3 + 25 / 325, rel=1e-5)
    c = torch.tensor([[20.0, 20.0, 30.0, 40.0]])  # disjoint, other aspect: above 1
    assert complete_box_iou_loss(a, c).item() > 1.0
    p = torch.tensor([[1.0, 1.0, 8.0, 12.0]], requires_grad=True)
    complete_box_iou_loss(p, a).sum().backward()
    assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0


# --------------------------------------------------------------------------- loss

def test_assign_targets_centre_cells_neighbours_and_conflicts():
    t = torch.tensor([[0, 1, 0.30, 0.30, 0.40, 0.40],     # centre cell (1, 1) of 4x4; (1, 0), (0, 1) nearest
                      [0, 2, 0.45, 0.32, 0.10, 0.10],     # centre (1, 1) too, smaller: wins it; (1, 2), (0, 1)
                      [1, 0, 0.99, 0.01, 0.05, 0.05]])    # image 1, centre (0, 3): neighbours off the grid
    pos, tid = assign_targets(t, 2, 4, 4, neighbours=False)
    assert dict(zip(pos.tolist(), tid.tolist())) == {1 * 4 + 1: 1, 16 + 3: 2}
    pos, tid = assign_targets(t, 2, 4, 4)
    got = dict(zip(pos.tolist(), tid.tolist()))
    assert got == {5: 1, 4: 0, 1: 1, 6: 1, 16 + 3: 2}


def test_loss_decreases_on_synthetic_images(glyph_set):
    torch.manual_seed(0)
    folder = read_yolo_folder(glyph_set)
    ds = DetectionDataset(folder.train[:6], 64)
    imgs, targets, _, _ = next(batches(ds, 6, shuffle=False))
    model = YOLOLAT(num_classes=10, width=16, heads=2)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(25):
        loss, parts = detection_loss(model(imgs), targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(parts["loss"])
        assert parts["positives"] > 0
    assert losses[-1] < 0.6 * losses[0]


def test_loss_without_objects_is_finite():
    model = YOLOLAT(num_classes=2, width=16, heads=2)
    loss, parts = detection_loss(model(torch.rand(2, 3, 32, 32)), torch.zeros(0, 6))
    loss.backward()
    assert math.isfinite(parts["loss"]) and parts["positives"] == 0 and parts["box"] == 0


# --------------------------------------------------------------------------- data

def _write(root: Path, split: str, stem: str, labels_text, size=(40, 48)):
    from PIL import Image

    (root / "images" / split).mkdir(parents=True, exist_ok=True)
    (root / "labels" / split).mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.zeros((size[1], size[0], 3), np.uint8)).save(root / "images" / split / f"{stem}.png")
    if labels_text is not None:
        (root / "labels" / split / f"{stem}.txt").write_text(labels_text)


def test_yolo_folder_round_trip(tmp_path):
    lab = torch.tensor([[3, 0.5, 0.5, 0.25, 0.5], [0, 0.2, 0.3, 0.1, 0.2]])
    img = np.random.default_rng(0).integers(0, 255, (48, 40, 3), dtype=np.uint8)
    write_yolo_item(tmp_path, "train", "a", img, lab)
    write_yolo_item(tmp_path, "val", "b", img, lab[:1])
    (tmp_path / "classes.txt").write_text("\n".join("abcd") + "\n")
    f = read_yolo_folder(tmp_path)
    assert [it.image.name for it in f.train] == ["a.png"] and [it.image.name for it in f.val] == ["b.png"]
    torch.testing.assert_close(f.train[0].labels, lab)
    assert f.class_names == list("abcd") and f.num_classes == 4
    assert format_label_lines(f.val[0].labels) == "3 0.500000 0.500000 0.250000 0.500000\n"
    # letterboxing a 40 x 48 image into 64: scale 4/3, 5 px padding left and right... boxes follow
    t, out, lb = letterbox(img, lab, 64)
    assert t.shape == (3, 64, 64)
    canvas = cxcywh_to_xyxy(out[:, 1:]) * 64
    back = lb.to_original(canvas)
    ref = cxcywh_to_xyxy(lab[:, 1:]) * torch.tensor([40, 48, 40, 48])
    torch.testing.assert_close(back, ref, atol=1e-3, rtol=0)


def test_yolo_folder_without_split_and_roboflow_layout(tmp_path):
    a = tmp_path / "flat"
    for i in range(30):
        _write(a, "", f"{i:02d}", "0 0.5 0.5 0.2 0.2\n")
    f = read_yolo_folder(a, val_fraction=0.3)
    assert len(f.train) + len(f.val) == 30 and 0 < len(f.val) < 30
    assert {it.image.name for it in f.val} == {it.image.name for it in read_yolo_folder(a, val_fraction=0.3).val}
    b = tmp_path / "rf"
    from PIL import Image

    for split in ("train", "valid"):
        (b / split / "images").mkdir(parents=True)
        (b / split / "labels").mkdir(parents=True)
        Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(b / split / "images" / "x.jpg")
        (b / split / "labels" / "x.txt").write_text("")
    f = read_yolo_folder(b)
    assert len(f.train) == 1 and len(f.val) == 1 and f.train[0].labels.shape == (0, 5)


@pytest.mark.parametrize("text, match", [
    ("0 0.5 0.5 0.2\n", "expected 5 fields"),
    ("0 0.5 0.5 0.2 0.2 0.1 0.1\n", "segmentation"),
    ("0 0.95 0.5 0.2 0.2\n", "outside"),
    ("0 1.5 0.5 0.2 0.2\n", "outside"),
    ("-1 0.5 0.5 0.2 0.2\n", "integer"),
    ("1.5 0.5 0.5 0.2 0.2\n", "integer"),
    ("0 0.5 0.5 0 0.2\n", "> 0"),
    ("0 0.5 abc 0.2 0.2\n", "not a number"),
    ("0 0.5 nan 0.2 0.2\n", "non-finite"),
    ("7 0.5 0.5 0.2 0.2\n", "out of range"),
])
def test_bad_label_lines(tmp_path, text, match):
    p = tmp_path / "x.txt"
    p.write_text("0 0.5 0.5 0.1 0.1\n" + text)
    with pytest.raises(DataError, match=match) as e:
        parse_label_file(p, num_classes=3)
    assert f"{p}:2" in str(e.value)


def test_image_without_label_file(tmp_path):
    _write(tmp_path, "train", "a", "0 0.5 0.5 0.2 0.2\n")
    _write(tmp_path, "train", "b", None)
    with pytest.raises(DataError, match="no label file"):
        read_yolo_folder(tmp_path)
    f = read_yolo_folder(tmp_path, allow_unlabeled=True)
    assert [it.labels.shape[0] for it in f.train] == [1, 0]


def test_bad_folders_and_images(tmp_path):
    with pytest.raises(DataError, match="not found"):
        read_yolo_folder(tmp_path / "missing")
    with pytest.raises(DataError, match="not a YOLO-format folder"):
        read_yolo_folder(tmp_path)
    _write(tmp_path, "train", "a", "0 0.5 0.5 0.2 0.2\n")
    (tmp_path / "images" / "train" / "bad.png").write_bytes(b"not a png")
    (tmp_path / "labels" / "train" / "bad.txt").write_text("")
    with pytest.raises(DataError, match="cannot read image"):
        read_yolo_folder(tmp_path)


def test_augmentation_is_deterministic_and_keeps_boxes_valid(glyph_set):
    folder = read_yolo_folder(glyph_set)
    ds = DetectionDataset(folder.train, 64, Augment(flip=0.5, scale=0.4, brightness=0.3), seed=3)
    for i in range(len(ds)):
        a, la, _ = ds.get(i, epoch=2)
        b, lb, _ = ds.get(i, epoch=2)
        assert torch.equal(a, b) and torch.equal(la, lb)
        assert a.min() >= 0 and a.max() <= 1
        xyxy = cxcywh_to_xyxy(la[:, 1:])
        assert (xyxy >= -1e-6).all() and (xyxy <= 1 + 1e-6).all() and (la[:, 3:] > 0).all()
    assert not torch.equal(ds.get(0, epoch=0)[0], ds.get(0, epoch=1)[0])


def test_synthetic_set_is_deterministic_and_reused(tmp_path, glyph_set):
    from linattn.vision.synthetic import SyntheticConfig, build_synthetic

    cfg = SyntheticConfig(n_train=12, n_val=4, size=64, min_digits=1, max_digits=2, min_scale=20, max_scale=32)
    other = build_synthetic(tmp_path / "again", "glyphs", cfg)
    for p in sorted((glyph_set / "labels" / "train").iterdir()):
        assert (other / "labels" / "train" / p.name).read_text() == p.read_text()
    a = read_yolo_folder(glyph_set)
    assert a.fingerprint() == read_yolo_folder(other).fingerprint() and a.num_classes == 10
    assert sum(it.labels.shape[0] for it in a.train) >= 12
    assert build_synthetic(other, None, cfg) == other           # identical settings: reused
    with pytest.raises(DataError, match="other settings"):
        build_synthetic(other, None, SyntheticConfig(n_train=3, n_val=1, size=64, min_scale=20, max_scale=32))


def test_synthetic_from_an_mnist_folder(tmp_path):
    from linattn.data.mnist import write_idx
    from linattn.vision.synthetic import SyntheticConfig, build_synthetic

    g = np.random.default_rng(0)
    (tmp_path / "mnist").mkdir()
    imgs = np.zeros((20, 28, 28), np.uint8)
    imgs[:, 6:22, 10:18] = 255                                   # a bar per "digit"
    for ni, nl in {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
                            "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}.values():
        write_idx(tmp_path / "mnist" / ni, imgs)
        write_idx(tmp_path / "mnist" / nl, g.integers(0, 10, 20).astype(np.uint8))
    root = build_synthetic(tmp_path / "s", tmp_path / "mnist", SyntheticConfig(n_train=3, n_val=2, size=64,
                                                                              min_scale=28, max_scale=28))
    f = read_yolo_folder(root)
    lab = f.train[0].labels
    assert lab.shape[0] >= 1
    # the box is the bar's tight box: 8 x 16 pixels of a 28-pixel cell pasted at scale 1 (+-1 px)
    w, h = (lab[0, 3:] * 64).tolist()
    assert abs(w - 8) <= 2 and abs(h - 16) <= 2


# --------------------------------------------------------------------------- metrics

@needs_coco
def test_map_perfect_and_shifted():
    from linattn.vision.metrics import MeanAP

    gt = torch.tensor([[10.0, 10.0, 50.0, 50.0], [60.0, 60.0, 90.0, 80.0]])
    m = MeanAP(["a", "b"])
    m.update(gt, torch.tensor([0.9, 0.8]), torch.tensor([0, 1]), gt, torch.tensor([0, 1]), 100, 100)
    r = m.compute()
    assert r["map"] == pytest.approx(1.0) and r["map_50"] == pytest.approx(1.0)
    assert r["per_class"]["a"]["ap"] == pytest.approx(1.0)
    m = MeanAP(["a", "b"])
    shifted = gt + torch.tensor([6.0, 0.0, 6.0, 0.0])          # IoU 34/46 = 0.74 and 24/36 = 0.67
    m.update(shifted, torch.tensor([0.9, 0.8]), torch.tensor([0, 1]), gt, torch.tensor([0, 1]), 100, 100)
    r = m.compute()
    assert r["map_50"] == pytest.approx(1.0) and 0.2 < r["map"] < 0.6
    m = MeanAP(num_classes=2)
    m.update(torch.zeros(0, 4), torch.zeros(0), torch.zeros(0, dtype=torch.long), gt, torch.tensor([0, 1]), 100, 100)
    assert m.compute()["map"] == 0.0


# --------------------------------------------------------------------------- training, commands

def _train_args(data, out, *extra):
    return ["vision", "train", "--data", str(data), "--out", str(out), "--image-size", "64", "--width", "16",
            "--heads", "2", "--batch-size", "4", "--warmup", "2", "--no-progress", *extra]


@needs_nms
@needs_coco
def test_train_resume_is_exact_and_commands_work(glyph_set, tmp_path, capsys):
    from safetensors.torch import load_file

    a, b = tmp_path / "a", tmp_path / "b"
    assert cli_main(_train_args(glyph_set, a, "--epochs", "2")) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["step"] == 6 and summary["val_map_50"] is not None
    assert cli_main(_train_args(glyph_set, b, "--epochs", "1")) == 0
    assert cli_main(_train_args(glyph_set, b, "--epochs", "2", "--resume")) == 0
    wa = load_file(str(a / "step_00000006" / "model.safetensors"))
    wb = load_file(str(b / "step_00000006" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    capsys.readouterr()
    # an occupied run folder is refused; a changed trajectory setting on resume too
    assert cli_main(_train_args(glyph_set, a, "--epochs", "2")) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert cli_main(_train_args(glyph_set, a, "--epochs", "3", "--resume", "--lr", "0.5")) == 2
    assert "mismatch" in capsys.readouterr().err

    # eval: prints and writes mAP@0.5, mAP@0.5:0.95, per-class AP
    assert cli_main(["vision", "eval", "--checkpoint", str(a), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "mAP@0.5" in out and "mAP@0.5:0.95" in out
    rec = json.loads((a / "eval.json").read_text())
    assert {"map", "map_50", "per_class"} <= set(rec)
    assert cli_main(["vision", "eval", "--checkpoint", str(a), "--no-progress"]) == 0   # no overwrite: new name
    assert len(list(a.glob("eval*.json"))) == 2

    # detect: writes annotated images + detections.json
    img = next((glyph_set / "images" / "val").iterdir())
    det_out = tmp_path / "det"
    assert cli_main(["vision", "detect", "--checkpoint", str(a), str(img), "--out", str(det_out),
                     "--conf-threshold", "0.01"]) == 0
    assert (det_out / (img.stem + ".png")).stat().st_size > 0
    assert json.loads((det_out / "detections.json").read_text())["images"][0]["image"] == str(img)
    assert cli_main(["vision", "detect", "--checkpoint", str(a), str(img), "--out", str(det_out)]) == 2
    assert "exists" in capsys.readouterr().err


def test_vision_commands_bad_input(tmp_path, capsys):
    assert cli_main(["vision"]) == 2
    assert "which action" in capsys.readouterr().err
    assert cli_main(["vision", "nope"]) == 2
    assert cli_main(["vision", "train", "--data", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    assert "no such folder" in capsys.readouterr().err
    assert cli_main(["vision", "train", "--neck", "lstm", "--out", str(tmp_path / "o")]) == 2
    assert cli_main(["vision", "eval", "--checkpoint", str(tmp_path / "none")]) == 2
    assert "checkpoint" in capsys.readouterr().err
    _write(tmp_path / "d", "train", "a", "0 0.5 0.5 0.2\n")
    assert cli_main(["vision", "train", "--data", str(tmp_path / "d"), "--out", str(tmp_path / "o"),
                     "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "expected 5 fields" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()   # nothing written on bad input


@pytest.mark.skipif(not _has("onnx"), reason="onnx not installed")
def test_export_onnx(tmp_path):
    from linattn.vision.export import export_onnx

    torch.manual_seed(0)
    model = YOLOLAT(num_classes=3, width=16, heads=2, image_size=64).eval()
    res = export_onnx(model, tmp_path / "m.onnx", 64)
    assert (tmp_path / "m.onnx").stat().st_size > 0
    if _has("onnxruntime"):
        assert res["checked"] and res["max_abs_diff_scores_b2"] < 1e-4


def test_bench_vision_tiny(tmp_path, capsys):
    rc = cli_main(["bench", "vision", "--sizes", "32", "--batches", "1", "--grids", "4", "8", "--width", "16",
                   "--repeats", "1", "--budget-s", "1", "--min-time-s", "0", "--out", str(tmp_path), "--quiet"])
    assert rc == 0
    assert "ms/img 32 b1" in capsys.readouterr().out
    data = json.loads((tmp_path / "vision.json").read_text())
    det = {r["neck"]: r for r in data["records"] if r["part"] == "detector"}
    assert set(det) == {"hadamard_exp", "softmax", "conv"} and all("ms_per_image" in r for r in det.values())
    neck = {(r["neck"], r["grid"]): r for r in data["records"] if r["part"] == "neck"}
    # softmax's attention FLOPs grow 16x with 4x the cells (quadratic), the linear attention's 4x
    soft = neck[("softmax", 8)]["flops"] / neck[("softmax", 4)]["flops"]
    lin = neck[("hadamard_exp", 8)]["flops"] / neck[("hadamard_exp", 4)]["flops"]
    assert soft > 5 and lin == pytest.approx(4, rel=0.01)
    assert cli_main(["bench", "vision", "--necks", "lstm"]) == 2
