"""Captures on disk: safetensors files plus a JSON index, memory-mapped on load, never pickled.

A capture directory holds::

    index.json                  format marker, the capture's ``info`` and every record's fields
    records/000000.safetensors  one file per record: its tensors (q, k, v, scores, weights, output,
    records/000001.safetensors  allowed, query_padding, sinks, and any tensor kept in its fields)

``Capture.save(path)`` writes one; ``capture(model, store=path)`` writes one while the model runs, each record
as it is made (at most one record's tensors are in memory at a time); ``attnprobe.load(path)`` reads one back
with every tensor memory-mapped (nothing is read from disk until the tensor is used).

Every value in the index is plain JSON with a few tagged types (tuples, frozensets, dtypes, tensors, attnprobe
``Violation`` records); loading builds nothing else, so a capture directory can come from anyone: it never runs
code (no pickle). A directory is written under a hidden temporary name beside the target and renamed into place
when complete, so an interrupted write leaves the previous directory (or none) and never a half-written one.
An existing path is replaced only with ``overwrite=True``, and then only when it is an attnprobe capture (or an
empty directory, or a symlink): a folder of other files is never deleted.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import secrets
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

import torch

from ..checks.violations import Violation
from ..errors import AttnprobeError
from ..files import write_atomic
from ..record import AttentionRecord

FORMAT = "attnprobe.capture"
VERSION = 1
INDEX = "index.json"
RECORDS = "records"

# the only classes an index may name (anything else in a record is refused when saving)
_DATACLASSES: dict[str, type] = {"Violation": Violation}


class CaptureFileError(AttnprobeError):
    """A capture directory that cannot be read or written."""


# ---------------------------------------------------------------- value <-> JSON (tensors set aside)
class _Encoder:
    """Turns record fields into JSON values; tensors go to ``tensors`` under a unique key."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.tensors: dict[str, torch.Tensor] = {}

    def __call__(self, value: Any, path: str) -> Any:
        if value is None or isinstance(value, (bool, int, str)):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else {"__float__": repr(value)}
        if isinstance(value, torch.Tensor):
            key = path if path not in self.tensors else f"{path}#{len(self.tensors)}"
            self.tensors[key] = value
            return {"__tensor__": key}
        if isinstance(value, torch.dtype):
            return {"__dtype__": str(value).removeprefix("torch.")}
        if isinstance(value, torch.device):
            return {"__device__": str(value)}
        if isinstance(value, tuple):
            return {"__tuple__": [self(v, f"{path}.{i}") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [self(v, f"{path}.{i}") for i, v in enumerate(value)]
        if isinstance(value, (set, frozenset)):
            return {"__frozenset__": [self(v, f"{path}.{i}") for i, v in enumerate(sorted(value, key=repr))]}
        if isinstance(value, Mapping):
            if all(isinstance(k, str) for k in value):
                return {"__dict__": {k: self(v, f"{path}.{k}") for k, v in value.items()}}
            return {"__items__": [[self(k, f"{path}.key"), self(v, f"{path}.{k}")] for k, v in value.items()]}
        if is_dataclass(value) and _DATACLASSES.get(type(value).__name__) is type(value):
            return {
                "__" + type(value).__name__ + "__": {
                    f.name: self(getattr(value, f.name), f"{path}.{f.name}") for f in fields(value)
                }
            }
        if isinstance(value, numbers.Integral):  # numpy integers
            return int(value)
        if isinstance(value, numbers.Real):  # numpy floats
            return self(float(value), path)
        raise CaptureFileError(
            f"cannot save {self.where} {path} of type {type(value).__name__}: a capture directory holds tensors, "
            "numbers, strings, lists, tuples and dicts of them only"
        )


def _decode(value: Any, tensors: Mapping[str, torch.Tensor], where: str) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors, where) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) != 1:
        raise CaptureFileError(
            f"{where}: unexpected entry {sorted(value)[:3]} in the index (written by another version?)"
        )
    ((tag, body),) = value.items()
    if tag == "__tensor__":
        if body not in tensors:
            raise CaptureFileError(f"{where}: tensor {body!r} is missing from its safetensors file")
        return tensors[body]
    if tag == "__float__":
        return float(body)
    if tag == "__dtype__":
        dtype = getattr(torch, str(body), None)
        if not isinstance(dtype, torch.dtype):
            raise CaptureFileError(f"{where}: unknown dtype {body!r}")
        return dtype
    if tag == "__device__":
        return torch.device(body)
    if tag == "__tuple__":
        return tuple(_decode(v, tensors, where) for v in body)
    if tag == "__frozenset__":
        return frozenset(_decode(v, tensors, where) for v in body)
    if tag == "__dict__":
        return {str(k): _decode(v, tensors, where) for k, v in body.items()}
    if tag == "__items__":
        return {_decode(k, tensors, where): _decode(v, tensors, where) for k, v in body}
    cls = _DATACLASSES.get(tag.strip("_"))
    if cls is not None and tag == f"__{cls.__name__}__":
        return cls(**{k: _decode(v, tensors, where) for k, v in body.items()})
    raise CaptureFileError(f"{where}: unknown entry {tag!r} in the index (written by another version of attnprobe?)")


# ---------------------------------------------------------------- paths
def _target(path) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"a capture directory is a path (str or pathlib.Path), got {type(path).__name__}")
    return Path(os.path.expanduser(os.fspath(path)))


def is_capture_dir(path: Path) -> bool:
    """Whether ``path`` is a directory written by attnprobe (it holds an index naming the format)."""
    try:
        with open(path / INDEX, encoding="utf-8") as f:
            return json.load(f).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def check_target(path, *, overwrite: bool) -> Path:
    """Refuse, before anything is written, a target that would lose data; returns the path."""
    target = _target(path)
    if target.is_symlink():
        if not overwrite:
            raise FileExistsError(f"{target} already exists (a symlink); pass overwrite=True to replace the link")
        return target
    if not target.exists():
        if target.parent.exists() and not target.parent.is_dir():
            raise NotADirectoryError(f"cannot write a capture into {target}: {target.parent} is not a directory")
        return target
    if not target.is_dir():
        raise FileExistsError(f"{target} is a file, not a capture directory; choose a new or empty folder")
    if not any(target.iterdir()):
        return target  # an empty folder made for the capture
    if not is_capture_dir(target):
        raise FileExistsError(
            f"{target} is a folder of other files (no attnprobe {INDEX}); attnprobe replaces only a capture "
            "directory it wrote: choose a new or empty folder"
        )
    if not overwrite:
        raise FileExistsError(f"{target} already holds a capture; pass overwrite=True to replace it")
    return target


def _new_folder(target: Path, kind: str) -> Path:
    """A new hidden folder beside ``target`` (permissions as any new folder: mkdtemp's would be private)."""
    for _ in range(100):
        folder = target.parent / f".{target.name[:200]}.{secrets.token_hex(4)}.{kind}"
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue
    raise FileExistsError(f"could not create a temporary folder beside {target}")  # pragma: no cover


def _move_into_place(staging: Path, target: Path) -> None:
    """Rename the complete ``staging`` folder to ``target``; an existing target (already checked) is set aside
    first and deleted only once the new folder is in place."""
    old = None
    if target.is_symlink() or target.exists():
        if target.is_dir() and not target.is_symlink() and not any(target.iterdir()):
            os.replace(staging, target)  # rename onto an empty directory is atomic
            return
        old = _new_folder(target, "old")
        os.rmdir(old)
        os.replace(target, old)
    try:
        os.replace(staging, target)
    except BaseException:
        if old is not None:
            os.replace(old, target)  # put the previous one back
        raise
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


# ---------------------------------------------------------------- writing
def _cpu_tensors(tensors: Mapping[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """What safetensors can write: CPU, contiguous, dense, no two tensors sharing memory."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, t in tensors.items():
        t = t.detach()
        if t.is_sparse or t.layout != torch.strided or t.is_complex():
            raise CaptureFileError(
                f"cannot save {where} tensor {key!r} ({t.layout}, {t.dtype}): only dense real tensors"
            )
        t = t.to("cpu").contiguous()
        if t.numel() and t.untyped_storage().data_ptr() in seen:
            t = t.clone()  # shares memory with another field (safetensors refuses that): its own copy
        if t.numel():
            seen.add(t.untyped_storage().data_ptr())
        out[key] = t
    return out


def encode_record(record: AttentionRecord) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A record as (JSON fields, tensors by key)."""
    enc = _Encoder(f"layer {record.layer} ({record.name!r}, call {record.call}): field")
    encoded = {f.name: enc(getattr(record, f.name), f.name) for f in fields(record)}
    return encoded, enc.tensors


class RecordWriter:
    """Writes records one by one into a staging folder, then moves the finished folder into place."""

    def __init__(self, path, *, overwrite: bool = False) -> None:
        self.target = check_target(path, overwrite=overwrite)
        self.overwrite = overwrite
        self.staging: Path | None = None
        self.entries: list[dict[str, Any]] = []

    def open(self) -> None:
        self.target.parent.mkdir(parents=True, exist_ok=True)
        check_target(self.target, overwrite=self.overwrite)  # again: the folder may have appeared since
        self.staging = _new_folder(self.target, "partial")
        (self.staging / RECORDS).mkdir()
        self.entries = []

    def write(self, record: AttentionRecord) -> AttentionRecord:
        """Write ``record``; return the same record with its tensors memory-mapped from the file."""
        from safetensors.torch import save_file

        assert self.staging is not None, "RecordWriter.open() first"
        encoded, tensors = encode_record(record)
        name = f"{RECORDS}/{len(self.entries):06d}.safetensors"
        path = self.staging / name
        save_file(_cpu_tensors(tensors, f"layer {record.layer}"), str(path), metadata={"format": FORMAT})
        self.entries.append({"file": name, "fields": encoded})
        return _read_record(self.entries[-1], self.staging)

    def close(self, info: Mapping[str, Any]) -> Path:
        """Write the index and move the folder into place; returns the final path."""
        assert self.staging is not None, "RecordWriter.open() first"
        try:
            enc = _Encoder("capture info")
            index = {"format": FORMAT, "version": VERSION, "info": enc(dict(info), "info"), "records": self.entries}
            if enc.tensors:
                raise CaptureFileError(f"cannot save tensors in capture info ({sorted(enc.tensors)[:3]})")
            write_atomic(self.staging / INDEX, json.dumps(index, indent=1, allow_nan=False))
        except BaseException:
            self.abort()
            raise
        staging, self.staging = self.staging, None
        try:
            check_target(self.target, overwrite=self.overwrite)  # again: something may have appeared there since
        except OSError as exc:
            raise FileExistsError(f"{exc}; the complete capture is kept in {staging}") from None
        try:
            _move_into_place(staging, self.target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return self.target

    def abort(self) -> None:
        """Delete the staging folder (the target is untouched)."""
        if self.staging is not None:
            shutil.rmtree(self.staging, ignore_errors=True)
            self.staging = None


def save(capture, path, *, overwrite: bool = False) -> Path:
    """Write ``capture`` to the directory ``path`` (see the module docstring); returns the path.

    Example::

        >>> import torch, attnprobe, tempfile, os
        >>> attn = attnprobe.MultiHeadAttention(8, num_heads=2)
        >>> with attnprobe.capture(attn) as cap:
        ...     _ = attn(torch.randn(1, 4, 8))
        >>> folder = os.path.join(tempfile.mkdtemp(), "cap")
        >>> _ = save(cap, folder)   # cap.save(folder)
        >>> records, info = read(folder)   # attnprobe.load(folder) is the Capture of these
        >>> torch.equal(records[0].weights, cap[0].weights)
        True
    """
    writer = RecordWriter(path, overwrite=overwrite)
    writer.open()
    try:
        for record in capture:
            writer.write(record)
    except BaseException:
        writer.abort()
        raise
    return writer.close(capture.info)


# ---------------------------------------------------------------- reading
def _read_record(entry: Mapping[str, Any], folder: Path) -> AttentionRecord:
    from safetensors import safe_open

    file = entry.get("file") if isinstance(entry, Mapping) else None
    if (
        not isinstance(file, str)
        or not file.startswith(f"{RECORDS}/")
        or ".." in file
        or not isinstance(entry.get("fields"), Mapping)
    ):
        raise CaptureFileError(f"{folder / INDEX}: a record entry is malformed ({str(entry)[:80]})")
    path = folder / file
    try:
        with safe_open(str(path), framework="pt") as f:  # tensors stay memory-mapped: read when first used
            # safe_open is no mapping: keys() is how it lists its tensors (it has no __iter__)
            tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118
    except FileNotFoundError:
        raise CaptureFileError(f"{path} is missing: the capture directory is incomplete") from None
    except Exception as exc:
        raise CaptureFileError(f"{path} is not a readable safetensors file ({exc})") from None
    where = f"{path}"
    values = {name: _decode(v, tensors, where) for name, v in entry["fields"].items()}
    known = {f.name for f in fields(AttentionRecord)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise CaptureFileError(
            f"{where}: record fields {unknown} are unknown to this attnprobe (written by a newer one?)"
        )
    try:
        return AttentionRecord(**values)
    except (TypeError, ValueError) as exc:
        raise CaptureFileError(f"{where}: not a valid record ({exc})") from None


def read(path) -> tuple[list[AttentionRecord], dict[str, Any]]:
    """The records and the info saved in directory ``path``, tensors memory-mapped (``attnprobe.load`` wraps them in
    a ``Capture``)."""
    folder = _target(path)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"{folder} is not a directory; give the folder written by cap.save() or capture(store=)"
        )
    try:
        with open(folder / INDEX, encoding="utf-8") as f:
            index = json.load(f)
    except FileNotFoundError:
        raise CaptureFileError(
            f"{folder} has no {INDEX}: not an attnprobe capture directory (or its writing was interrupted)"
        ) from None
    except ValueError as exc:
        raise CaptureFileError(f"{folder / INDEX} is not valid JSON ({exc})") from None
    if not isinstance(index, Mapping) or index.get("format") != FORMAT:
        raise CaptureFileError(f"{folder / INDEX} is not an attnprobe capture index")
    if index.get("version") != VERSION:
        raise CaptureFileError(
            f"{folder} was written in capture format version {index.get('version')!r}; this attnprobe reads "
            f"version {VERSION}: load it with the attnprobe release that wrote it"
        )
    info = _decode(index.get("info", {"__dict__": {}}), {}, str(folder / INDEX))
    records: Iterable[Any] = index.get("records", [])
    return [_read_record(entry, folder) for entry in records], info
