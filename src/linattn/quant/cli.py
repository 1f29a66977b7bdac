"""The command line's side of quantization: `--quantize` / `--group-size` for `linattn generate` and `linattn eval`,
and `linattn quantize` (a float checkpoint -> a quantized folder, docs/quantization.md)."""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ..checkpoint import Checkpoint, load_checkpoint
from ..errors import LinattnError
from .linear import ACTIVATIONS, GROUP_SIZES, MODES
from .model import quantization_summary, quantize
from .store import is_quantized_dir, load_quantized, read_manifest, save_quantized


def add_quantize_arguments(p: argparse.ArgumentParser) -> None:
    """--quantize, --group-size and --activations (generate, eval)."""
    p.add_argument("--quantize", choices=MODES, default=None,
                   help="run with int8 (per-row scales) or int4 (per-group scales) weights, CPU only (default: "
                        "the checkpoint's own weights; a folder written by `linattn quantize` loads as it is)")
    p.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=None,
                   help="int4's group of inputs sharing a scale (default 32)")
    _add_activations(p)


def _add_activations(p: argparse.ArgumentParser) -> None:
    p.add_argument("--activations", choices=ACTIVATIONS, default=None,
                   help="int8: the quantized products round their inputs to int8 per block of 32 (faster decoding, "
                        "a small extra error; docs/quantization.md); float: exact inputs. Default: int8")


def load_for_inference(checkpoint: str, device, mode=None, group_size=None, activations=None) -> Checkpoint:
    """A checkpoint (a run or step folder, or a folder written by `linattn quantize`), quantized when `mode` says.

    Raises:
        LinattnError: Quantizing a quantized folder, a quantized model off the CPU, a bad mode or group size,
            --activations without --quantize.
        CheckpointError: The checkpoint cannot be read.
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    if (mode is not None or is_quantized_dir(checkpoint)) and device.type != "cpu":
        raise LinattnError(f"quantized weights run on the CPU only: pass --device cpu (got {device})")
    if group_size is not None and mode is None:
        raise LinattnError("--group-size needs --quantize int4")
    if activations is not None and mode is None:
        raise LinattnError("--activations needs --quantize int8|int4 (a folder written by `linattn quantize` keeps "
                           "the activations it was written with)")
    if is_quantized_dir(checkpoint):
        if mode is not None:
            raise LinattnError(f"{checkpoint} is already quantized ({read_manifest(checkpoint)['mode']}); drop "
                               f"--quantize, or quantize the float checkpoint it came from")
        return _quantized_checkpoint(checkpoint)
    ck = load_checkpoint(checkpoint, device=device)
    if mode is not None:
        ck.model = quantize(ck.model, mode, group_size=group_size, activations=activations, inplace=True)
    return ck


def _quantized_checkpoint(path) -> Checkpoint:
    model, tokenizer = load_quantized(path)
    source = read_manifest(path).get("source") or {}
    return Checkpoint(path=Path(path), step=int(source.get("step") or 0), model=model, model_config=model.config,
                      config={"model": model.config.to_dict()}, tokenizer=tokenizer,
                      train_config=dict(source.get("train_config") or {}))


def add_command_arguments(p: argparse.ArgumentParser) -> None:
    """`linattn quantize`'s flags."""
    p.add_argument("--checkpoint", required=True, help="the float checkpoint: run folder (its latest) or step folder")
    p.add_argument("--mode", required=True, choices=MODES, help="int8 (per-row scales) or int4 (per-group scales)")
    p.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=None, help="int4's group (default 32)")
    _add_activations(p)
    p.add_argument("--out", required=True, help="the folder to write (quantized.json, quantized.safetensors, "
                                                "tokenizer.json); generate / eval take it as --checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")


def command_main(args: argparse.Namespace) -> int:
    """`linattn quantize --checkpoint DIR --mode int8|int4 --out QDIR`."""
    ck = load_for_inference(args.checkpoint, "cpu", args.mode, args.group_size, args.activations)
    out = save_quantized(ck.model, args.out, tokenizer=ck.tokenizer, overwrite=args.overwrite,
                         source={"checkpoint": str(ck.path), "step": ck.step, "train_config": ck.train_config})
    s = quantization_summary(ck.model)
    print(f"[linattn] wrote {out}: {len(s['modules'])} {s['mode']} linear layers ({s['bytes'] / 2 ** 20:.2f} MiB), "
          f"{len(s['skipped'])} left in float")
    return 0
