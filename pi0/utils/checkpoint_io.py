"""safetensors I/O with early, explicit errors, streamed both ways so memory never holds two copies.

The format is an 8-byte little-endian header length, a JSON header ``{name: {"dtype", "shape",
"data_offsets": [begin, end]}}`` (offsets relative to the end of the header), then the raw bytes.
``SafetensorsWriter`` writes the header first from known shapes and dtypes and then each tensor at its
offset; ``load_safetensors_into`` reads each tensor with a positioned read straight into the storage of
an already allocated parameter (no mmap: touched file pages would count as resident memory a second time).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

POLICY_FILES = ("model.safetensors", "config.json", "norm_stats.json", "tokenizer.model")
# safetensors dtype names <-> torch dtypes (the ones pi0 checkpoints use, plus common others)
ST_DTYPES: dict[str, torch.dtype] = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                                     "F64": torch.float64, "I64": torch.int64, "I32": torch.int32,
                                     "U8": torch.uint8, "BOOL": torch.bool}
ST_NAMES: dict[torch.dtype, str] = {v: k for k, v in ST_DTYPES.items()}


def check_policy_dir(directory: Path) -> dict[str, Path]:
    """Check that a policy directory exists and holds every file -> {file name: path}."""
    if not directory.exists():
        raise FileNotFoundError(
            f"checkpoint directory {directory} does not exist. Convert an openpi checkpoint with "
            f"`python convert_pi0_to_hf_lerobot.py --checkpoint_dir <ckpt>/params --output_path {directory}` "
            f"or save one with PI0Policy.save_pretrained().")
    if not directory.is_dir():
        raise NotADirectoryError(f"{directory} is a file; expected a policy directory holding {list(POLICY_FILES)}")
    missing = [f for f in POLICY_FILES if not (directory / f).is_file()]
    if missing:
        hint = {
            "norm_stats.json": "copy openpi's <ckpt>/assets/<asset_id>/norm_stats.json there "
                               "(or re-run the converter with --norm_stats PATH)",
            "tokenizer.model": "copy PaliGemma's sentencepiece model there (or re-run the converter with --tokenizer)",
        }
        hints = "; ".join(hint[f] for f in missing if f in hint)
        raise FileNotFoundError(f"{directory} lacks {missing}" + (f": {hints}" if hints else ""))
    return {f: directory / f for f in POLICY_FILES}


# ---------------------------------------------------------------------------------------------- header
@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: dtype, shape and absolute byte range in the file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def read_safetensors_header(path: Path) -> dict[str, TensorEntry]:
    """Parse a safetensors header -> {name: TensorEntry}; a truncated or corrupt file raises ValueError."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path} is not a safetensors file ({size} bytes): re-download or re-convert it")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8:
            raise ValueError(f"{path} is truncated or corrupt (header says {header_len} bytes, file has {size}): "
                             f"re-convert or re-copy it")
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
        header.pop("__metadata__", None)
        out = {}
        for name, e in header.items():
            begin, end = (8 + header_len + int(o) for o in e["data_offsets"])
            dtype, shape = ST_DTYPES[e["dtype"]], tuple(int(s) for s in e["shape"])
            if end - begin != math.prod(shape) * dtype.itemsize:
                raise ValueError(f"tensor {name}: {end - begin} bytes for shape {shape} {e['dtype']}")
            out[name] = TensorEntry(dtype, shape, begin, end)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is truncated or corrupt (bad header: {e}): re-convert or re-copy it") from e
    last = max((e.end for e in out.values()), default=8 + header_len)
    if last > size:
        raise ValueError(f"{path} is truncated or corrupt (data ends at byte {last}, file has {size}): "
                         f"re-convert or re-copy it")
    return out


class SafetensorsWriter:
    """Write a safetensors file tensor by tensor: header first (from shapes/dtypes), then each tensor's bytes.

    Tensors are laid out by decreasing itemsize, then name (every tensor stays aligned to its itemsize).
    The file appears at ``path`` only after ``close()`` saw every tensor written (tmp file + rename).
    """

    def __init__(self, path: Path, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self._tmp = self.path.with_name(self.path.name + ".tmp")
        order = sorted(specs, key=lambda n: (-specs[n][0].itemsize, n))
        header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
        self._entries: dict[str, TensorEntry] = {}
        pos = 0
        for name in order:
            dtype, shape = specs[name]
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": ST_NAMES[dtype], "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
            self._entries[name] = TensorEntry(dtype, tuple(shape), pos, pos + nbytes)
            pos += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._data_start = 8 + len(raw)
        self._f = open(self._tmp, "wb")
        self._f.write(struct.pack("<Q", len(raw)) + raw)
        self._f.truncate(self._data_start + pos)
        self._pending = set(specs)

    def write(self, name: str, data: torch.Tensor | np.ndarray) -> None:
        """Write one tensor (already in its declared dtype and shape) at its offset."""
        e = self._entries.get(name)
        if e is None or name not in self._pending:
            raise ValueError(f"tensor {name} was not declared or was written twice")
        if isinstance(data, np.ndarray):
            arr = np.ascontiguousarray(data)
            if arr.dtype.itemsize != e.dtype.itemsize or arr.shape != e.shape:
                raise ValueError(f"tensor {name}: got {arr.dtype} {arr.shape}, declared {e.dtype} {e.shape}")
            buf = arr.reshape(-1).view(np.uint8)
        else:
            if data.dtype != e.dtype or tuple(data.shape) != e.shape:
                raise ValueError(f"tensor {name}: got {data.dtype} {tuple(data.shape)}, declared {e.dtype} {e.shape}")
            buf = data.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        self._f.seek(self._data_start + e.start)
        self._f.write(memoryview(buf))
        self._pending.discard(name)

    def write_zeros(self, name: str) -> None:
        """Mark a declared tensor as all zeros: its bytes already are (the file was created at full size), so
        nothing is allocated or written."""
        if name not in self._pending:
            raise ValueError(f"tensor {name} was not declared or was written twice")
        self._pending.discard(name)

    def close(self) -> None:
        """Finish: every declared tensor must have been written; then the file is moved into place."""
        self._f.close()
        if self._pending:
            self._tmp.unlink(missing_ok=True)
            raise ValueError(f"safetensors file {self.path} incomplete: never wrote {sorted(self._pending)[:5]}")
        self._tmp.replace(self.path)

    def abort(self) -> None:
        """Drop the partial file."""
        self._f.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> "SafetensorsWriter":
        """Context manager: ``close()`` on success, ``abort()`` on an exception."""
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Finish or drop the file."""
        if exc_type is None:
            self.close()
        else:
            self.abort()


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write tensors atomically (tmp file + rename), so a crash never leaves a truncated checkpoint."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(path)


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Read a whole safetensors file into memory; a truncated or corrupt file raises ValueError naming it."""
    read_safetensors_header(path)
    try:
        return load_file(str(path))
    except Exception as e:  # noqa: BLE001 (safetensors raises its own error types)
        raise ValueError(f"{path} is truncated or corrupt ({e}): re-convert or re-copy it") from e


# ---------------------------------------------------------------------------------------------- loading
def _check_keys(own: dict[str, tuple[int, ...]], theirs: dict[str, tuple[int, ...]], source: object) -> None:
    """Raise ValueError naming missing / unexpected / mis-shaped keys."""
    missing = sorted(set(own) - set(theirs))
    unexpected = sorted(set(theirs) - set(own))
    bad_shape = [f"{k}: checkpoint {theirs[k]} vs model {own[k]}" for k in own if k in theirs and theirs[k] != own[k]]
    if missing or unexpected or bad_shape:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} key(s), e.g. {missing[:5]}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} key(s), e.g. {unexpected[:5]}")
        if bad_shape:
            parts.append(f"shape mismatch in {len(bad_shape)} tensor(s), e.g. {bad_shape[:3]}")
        raise ValueError(f"{source} does not match the model config: " + "; ".join(parts) +
                         ". Check config.json against the weights (was the checkpoint converted for another variant?)")


def load_into(model: nn.Module, state: dict[str, torch.Tensor], source: object = "state dict") -> None:
    """Strictly copy ``state`` into ``model``: every key must exist on both sides with the same shape."""
    own = model.state_dict()
    _check_keys({k: tuple(t.shape) for k, t in own.items()}, {k: tuple(t.shape) for k, t in state.items()}, source)
    with torch.no_grad():
        for k, t in own.items():
            t.copy_(state[k].to(t.dtype))


def check_safetensors_matches(model: nn.Module, path: Path, prefix: str = "") -> dict[str, TensorEntry]:
    """Header-only strict check of ``path`` against ``model`` (may live on meta) -> {model key: entry}."""
    entries = {k.removeprefix(prefix): e for k, e in read_safetensors_header(path).items()}
    own = {k: tuple(t.shape) for k, t in model.state_dict().items()}
    _check_keys(own, {k: e.shape for k, e in entries.items()}, path)
    return entries


def _pread_into(fd: int, buf: torch.Tensor, entry: TensorEntry, path: Path, name: str) -> None:
    """Fill the contiguous CPU tensor ``buf`` with ``entry``'s bytes by positioned reads (no mmap)."""
    view = buf.reshape(-1).view(torch.uint8).numpy()
    done = 0
    while done < view.size:  # preadv may return short reads for large tensors
        n = os.preadv(fd, [memoryview(view[done:])], entry.start + done)
        if n <= 0:
            raise ValueError(f"{path} is truncated or corrupt (short read in {name}): re-convert it")
        done += n


def read_tensor(path: Path, entry: TensorEntry, name: str = "tensor") -> torch.Tensor:
    """One tensor of a safetensors file (its header ``entry``) -> a fresh CPU tensor in its stored dtype."""
    buf = torch.empty(entry.shape, dtype=entry.dtype)
    fd = os.open(path, os.O_RDONLY)
    try:
        _pread_into(fd, buf, entry, path, name)
    finally:
        os.close(fd)
    return buf


@torch.no_grad()
def load_entries_into(model: nn.Module, sources: dict[str, tuple[Path, TensorEntry]]) -> None:
    """Fill every tensor of ``model`` (allocated, any device/dtype) from {model key: (file, header entry)}, one tensor
    at a time; each is cast on its own into the parameter's dtype.

    A tensor stored in the parameter's dtype on CPU is read straight into the parameter's memory; otherwise
    one tensor-sized CPU buffer is read and cast/copied (peak extra memory = the largest tensor).
    """
    fds: dict[Path, int] = {}
    try:
        for k, t in model.state_dict().items():
            path, e = sources[k]
            if path not in fds:
                fds[path] = os.open(path, os.O_RDONLY)
            direct = t.device.type == "cpu" and t.dtype == e.dtype and t.is_contiguous()
            buf = t if direct else torch.empty(e.shape, dtype=e.dtype)
            _pread_into(fds[path], buf, e, path, k)
            if not direct:
                t.copy_(buf)
                del buf
    finally:
        for fd in fds.values():
            os.close(fd)


def load_safetensors_into(model: nn.Module, path: Path, prefix: str = "") -> None:
    """Fill every tensor of ``model`` from ``path`` (keys ``prefix`` + model key), strictly, one tensor at a time."""
    entries = check_safetensors_matches(model, path, prefix)
    load_entries_into(model, {k: (path, e) for k, e in entries.items()})


@contextlib.contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Yield a sibling temp directory to fill; on success it replaces ``path`` (one rename), on an error it is
    removed, so a failed write never leaves a partial ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        yield tmp
        if path.exists():
            shutil.rmtree(path)
        tmp.chmod(0o755)
        tmp.rename(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
