"""A warm start for the next GPU machine: Triton's compiled kernels packed into one archive of at most 16 MiB
(the most the device tool brings back per file), and unpacked into `TRITON_CACHE_DIR` before a run.

Triton keeps one folder per compiled kernel (the binary, its intermediate forms, a metadata file and a group
file that lists them); a kernel is reused only when every file its group lists is there, so folders are packed
whole, newest first, until the next one would pass the limit (the ones left out are listed)."""
from __future__ import annotations

import io
import os
import tarfile
import tempfile
import zlib
from pathlib import Path
from typing import Any, Dict, List

ARCHIVE_NAME = "triton-cache.tar.gz"
LIMIT_BYTES = 16 * 2 ** 20 - 64 * 2 ** 10  # 16 MiB, less a margin for the tar and gzip framing


def prepare_cache_dir(archive: str = None) -> Dict[str, Any]:
    """Point TRITON_CACHE_DIR at a folder (the caller's when set, else a fresh temporary one) before anything
    compiles, and unpack `archive` into it; autotuning results cached there too (TRITON_CACHE_AUTOTUNING=1 unless
    the caller set it: the H200 run of 2026-11-30 spent minutes autotuning fla-core's kernels, which a warm start
    otherwise repeats). -> {"dir", "unpacked": number of files, "archive", "autotuning"}."""
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    folder = os.environ.get("TRITON_CACHE_DIR")
    if not folder:
        folder = tempfile.mkdtemp(prefix="linattn-triton-cache-")
        os.environ["TRITON_CACHE_DIR"] = folder
    info: Dict[str, Any] = {"dir": folder, "unpacked": 0, "archive": archive,
                            "autotuning": os.environ["TRITON_CACHE_AUTOTUNING"]}
    if archive:
        info["unpacked"] = unpack(archive, folder)
    return info


def _safe_members(tar: tarfile.TarFile, dest: Path) -> List[tarfile.TarInfo]:
    """Regular files and folders that land inside `dest` (no links, devices, absolute paths or `..`)."""
    out = []
    root = dest.resolve()
    for m in tar.getmembers():
        target = (dest / m.name).resolve()
        if not (m.isfile() or m.isdir()) or os.path.isabs(m.name) or (root not in target.parents and target != root):
            raise ValueError(f"unsafe entry {m.name!r} in the Triton cache archive")
        out.append(m)
    return out


def unpack(archive: str, dest: str) -> int:
    """Extract `archive` into `dest`; -> the number of files. Raises ValueError on an unsafe entry."""
    d = Path(dest)
    d.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:gz") as tar:
        members = _safe_members(tar, d)
        for m in members:
            if m.isdir():
                (d / m.name).mkdir(parents=True, exist_ok=True)
                continue
            (d / m.name).parent.mkdir(parents=True, exist_ok=True)
            src = tar.extractfile(m)
            (d / m.name).write_bytes(src.read() if src is not None else b"")
    return sum(1 for m in members if m.isfile())


def _compressed_size(folder: Path) -> int:
    """About what the folder's files add to a gzip stream (zlib at gzip's default level)."""
    c = zlib.compressobj(9)
    n = 0
    for f in sorted(folder.rglob("*")):
        if f.is_file():
            n += len(c.compress(f.read_bytes())) + 512  # + a tar header
    return n + len(c.flush())


def pack(cache_dir: str, archive: str, limit: int = LIMIT_BYTES) -> Dict[str, Any]:
    """Pack the kernel folders of `cache_dir`, newest first, into `archive` (written to a temporary name and
    renamed, so a run cut while packing leaves the previous archive). -> {"kernels", "left_out", "bytes"}."""
    root = Path(cache_dir)
    folders = sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True) \
        if root.is_dir() else []
    chosen, left_out, total = [], [], 0
    for f in folders:
        size = _compressed_size(f)
        if total + size > limit:
            left_out.append(f.name)
            continue
        chosen.append(f)
        total += size
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=9) as tar:
        for f in chosen:
            tar.add(str(f), arcname=f.name)
    data = buf.getvalue()
    if len(data) > limit + 64 * 2 ** 10:  # the estimate was off: say so rather than write what cannot come back
        raise ValueError(f"the Triton cache archive came to {len(data)} bytes, over the 16 MiB limit")
    tmp = Path(str(archive) + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, archive)
    return {"kernels": len(chosen), "left_out": left_out, "bytes": len(data)}
