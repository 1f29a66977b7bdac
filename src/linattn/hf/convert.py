"""Conversions between linattn checkpoints and Hugging Face folders, and the CLI commands on them.

    export_hf("runs/efla", "hf_dir")     # the latest checkpoint + its tokenizer -> a transformers folder
    import_hf("hf_dir", "runs/back")     # a transformers folder -> a linattn checkpoint (weights only)
    import_hf("fla_dir", "runs/gla")     # a flash-linear-attention folder, too (`linattn.hf.fla.import_fla`)

An exported folder holds config.json (with `auto_map`), model.safetensors, generation_config.json,
the trust_remote_code modules, and the tokenizer (tokenizer.json + tokenizer_config.json, with
`<|endoftext|>` as the eos, bos and pad token, and the stock class `PreTrainedTokenizerFast`), so
`AutoTokenizer.from_pretrained(HF_DIR)` and `pipeline("text-generation", model=HF_DIR)` work after
`import linattn.hf`, and `PreTrainedTokenizerFast.from_pretrained(HF_DIR)` in any process (transformers 5's
AutoTokenizer reads config.json first, and without linattn.hf its `auto_map` makes it ask to run code).
Every file gets the mode the umask gives. Both directions write into a temporary folder
that is renamed into place at the end, and refuse an existing output unless `overwrite`.
"""
from __future__ import annotations

import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Optional, Union

from .. import checkpoint as ckpt
from ..data.tokenizer import BPETokenizer, TokenizerError
from ..errors import CheckpointError
from ..io import TMP_PREFIX, give_default_modes, read_json, write_json
from ..models.family import config_to_dict
from ..models.lm import LanguageModel
from .fla import import_fla, refuse_non_float, supported_types
from .import_target import write_import
from .modeling_linattn import LinattnForCausalLM
from .tokenizer_import import import_tokenizer

PathLike = Union[str, os.PathLike]


def hf_tokenizer(tokenizer: BPETokenizer):
    """linattn's tokenizer as a transformers fast tokenizer (eos = bos = pad = its end-of-text token).

    Args:
        tokenizer: The linattn tokenizer.

    Returns:
        A transformers `PreTrainedTokenizerFast` encoding as `tokenizer` does.
    """
    from transformers import PreTrainedTokenizerFast

    eos = tokenizer.eos_token
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend, eos_token=eos, bos_token=eos,
                                   pad_token=eos, padding_side="left", clean_up_tokenization_spaces=False)


def _plain_tokenizer_config(folder: Path) -> None:
    """tokenizer_config.json naming a stock transformers class and no `auto_map`, so that loading the
    tokenizer never needs linattn's code (`PreTrainedTokenizerFast.from_pretrained(folder)` runs none)."""
    f = folder / "tokenizer_config.json"
    cfg = read_json(f)
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{f}: transformers wrote no tokenizer config object")
    cfg.pop("auto_map", None)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    write_json(f, cfg)


def _claim(out: Path, overwrite: bool, what: str) -> Path:
    """A fresh temporary folder next to `out`; refuses an existing non-empty `out` unless overwrite."""
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out} already exists; pass --overwrite to replace it with the {what}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f"{TMP_PREFIX}{out.name}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)   # a leftover of a killed export
    tmp.mkdir()
    return tmp


def _commit(tmp: Path, out: Path) -> None:
    if out.exists():
        old = out.parent / f"{TMP_PREFIX}old-{out.name}.{os.getpid()}"
        os.replace(out, old)
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink()
    os.replace(tmp, out)


def export_hf(checkpoint: PathLike, out: PathLike, *, overwrite: bool = False,
              safe_serialization: bool = True) -> Path:
    """Write a linattn checkpoint as a transformers folder, with the tokenizer.

    Args:
        checkpoint: The linattn checkpoint: a run folder (its latest step) or a step folder.
        out: The transformers folder to write.
        overwrite: Replace an existing `out`.
        safe_serialization: Write the weights as safetensors (else a PyTorch file).

    Returns:
        `out`.

    Raises:
        CheckpointError: The checkpoint is missing, unreadable or not of the 'lm' family, or `out` exists
            without overwrite.
    """
    from ..quant import refuse_quantized  # a quantized folder is not a transformers model's weights
    refuse_quantized(checkpoint, "export-hf")
    ck = ckpt.load_checkpoint(checkpoint)
    if not isinstance(ck.model, LanguageModel):
        raise CheckpointError(f"{ck.path}: only the 'lm' model family converts to transformers, this checkpoint "
                              f"holds a {type(ck.model).__name__}")
    out = Path(out)
    tmp = _claim(out, overwrite, "exported model")
    try:
        eos = ck.tokenizer.eos_id if ck.tokenizer is not None else None
        hf = LinattnForCausalLM.from_linattn(ck.model, eos_token_id=eos, bos_token_id=eos, pad_token_id=eos,
                                             linattn_step=ck.step)
        if eos is not None:
            hf.generation_config.update(eos_token_id=eos, bos_token_id=eos, pad_token_id=eos)
        hf.save_pretrained(tmp, safe_serialization=safe_serialization)
        if ck.tokenizer is not None:
            hf_tokenizer(ck.tokenizer).save_pretrained(tmp)
            _plain_tokenizer_config(tmp)
        give_default_modes(tmp)   # every file as the umask says (safetensors writes its files 0600)
        _commit(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def import_hf(hf_dir: PathLike, out: PathLike, *, overwrite: bool = False, step: Optional[int] = None,
              tokenizer: Optional[PathLike] = None) -> Path:
    """Write a transformers folder as a linattn checkpoint (weights, model config, tokenizer; no training state).

    The folder `hf_dir` holds a LinattnForCausalLM. A flash-linear-attention model folder (config.json's
    model_type one of `linattn.hf.fla.supported_types()`) goes to `import_fla`; any other model_type is a
    CheckpointError listing the supported ones.

    Args:
        hf_dir: The transformers folder.
        out: The linattn run folder to write into.
        overwrite: Replace the checkpoints `out` already holds.
        step: The step number the checkpoint is written as (None: the step export_hf recorded, or 0).
        tokenizer: The tokenizer to keep (a folder, tokenizer.json or tokenizer.model; None: the folder's own, see
            `tokenizer_import`).

    Returns:
        The step folder.

    Raises:
        CheckpointError: An unsupported or unreadable folder, or `out` holding a checkpoint without overwrite.
    """
    hf_dir, out = Path(hf_dir), Path(out)
    if not hf_dir.exists():
        raise CheckpointError(f"--model {hf_dir}: not found")
    if not (hf_dir / "config.json").is_file():
        raise CheckpointError(f"{hf_dir} is not a transformers model folder (no config.json)")
    cfg = read_json(hf_dir / "config.json")
    model_type = cfg.get("model_type") if isinstance(cfg, dict) else None
    if model_type in supported_types():
        return import_fla(hf_dir, out, overwrite=overwrite, step=step or 0, tokenizer=tokenizer)
    ours = LinattnForCausalLM.config_class.model_type
    if model_type != ours:
        what = "no model_type" if model_type is None else f"unsupported model_type {model_type!r}"
        raise CheckpointError(f"{hf_dir / 'config.json'}: {what}; import-hf reads {ours!r} (a folder written by "
                              f"export-hf) and the flash-linear-attention types {', '.join(supported_types())}")

    def write(run: Path) -> Path:
        hf = _load_strictly(hf_dir)
        model = hf.to_linattn()
        try:
            tok = import_tokenizer(hf_dir, model.config.vocab_size, tokenizer)
        except TokenizerError as e:
            raise CheckpointError(str(e)) from None
        s = int(step if step is not None else getattr(hf.config, "linattn_step", 0) or 0)
        return ckpt.save_checkpoint(run, s, model, model_config=config_to_dict(model.config), tokenizer=tok,
                                    extra={"imported_from": str(hf_dir), "n_params": model.num_parameters()},
                                    keep_last=None)

    return write_import(hf_dir, out, overwrite, write)


def _refuse_non_float_files(hf_dir: Path) -> None:
    """transformers casts an int / bool / complex tensor into a float parameter without a word: refuse it."""
    from safetensors import safe_open

    for f in sorted(hf_dir.glob("*.safetensors")):
        try:
            with safe_open(str(f), "pt") as fh:
                for name in fh.keys():
                    refuse_non_float(name, fh.get_slice(name).get_dtype(), hf_dir)
        except CheckpointError:
            raise
        except Exception:  # an unreadable file: from_pretrained says why
            return


def _load_strictly(hf_dir: Path) -> LinattnForCausalLM:
    """The saved LinattnForCausalLM, every parameter read from the folder: transformers fills a tensor the files
    lack with whatever it initialises (or leaves in memory), and skips a tensor the model lacks, so both refuse."""
    _refuse_non_float_files(hf_dir)
    try:
        hf, info = LinattnForCausalLM.from_pretrained(hf_dir, output_loading_info=True, ignore_mismatched_sizes=True)
    except Exception as e:  # OSError, ValueError, safetensors' errors on a truncated file, a shape mismatch
        raise CheckpointError(f"cannot load {hf_dir} as a linattn transformers model: {type(e).__name__}: "
                              f"{' '.join(str(e).split())[:300]}") from None
    for kind, what in (("missing_keys", "lack the tensors"), ("unexpected_keys", "hold tensors the model has not"),
                       ("mismatched_keys", "hold tensors of the wrong shape")):
        names = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get(kind) or ())
        if names:
            raise CheckpointError(f"the weights of {hf_dir} {what}: {', '.join(names[:8])}"
                                  + (f" and {len(names) - 8} more" if len(names) > 8 else ""))
    return hf


# --------------------------------------------------------------------------- the CLI commands

def export_main(args) -> int:
    """`linattn export-hf --checkpoint DIR --out HF_DIR [--overwrite]`."""
    out = export_hf(args.checkpoint, args.out, overwrite=args.overwrite)
    print(f"[linattn] wrote {out} (load it with AutoModelForCausalLM.from_pretrained after `import linattn.hf`, "
          f"or with trust_remote_code=True; its tokenizer with PreTrainedTokenizerFast.from_pretrained)")
    return 0


def import_main(args) -> int:
    """`linattn import-hf --model HF_DIR --out DIR [--overwrite] [--tokenizer PATH]` (a linattn or fla folder).
    The import's warnings are one `[linattn] warning:` line each on stderr (not Python's file:line form)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            step_dir = import_hf(args.model, args.out, overwrite=args.overwrite,
                                 tokenizer=getattr(args, "tokenizer", None))
        finally:
            for w in seen:
                print(f"[linattn] warning: {' '.join(str(w.message).split())}", file=sys.stderr)
    print(f"[linattn] wrote {step_dir}")
    return 0


__all__ = ["export_hf", "import_hf", "hf_tokenizer", "export_main", "import_main"]
