"""Reading DCP checkpoints without running untrusted code, and counting the bytes read.

What ``torch.distributed.checkpoint`` (DCP) stores: tensors in ``*.distcp`` files (``torch.save`` format,
read back with ``torch.load(weights_only=True)``), non-tensor values (optimizer hyper-parameters, ...) as
``torch.save``'d byte blobs, and a ``.metadata`` file written with plain ``pickle``. Stock DCP unpickles
``.metadata`` with ``pickle.load`` and the byte blobs with ``torch.load(weights_only=False)``: loading a
checkpoint from an untrusted source can run arbitrary code.

hsdp never does either: :class:`CheckpointReader` unpickles ``.metadata`` with an allow-list of DCP's
own metadata classes (anything else raises), and :class:`SafeLoadPlanner` loads byte blobs with
``torch.load(weights_only=True)``, which only rebuilds tensors and plain containers. ``extra`` is JSON.
Checkpoints written by hsdp load under either reader; checkpoints written by other tools do as long as
their non-tensor values are plain data.
"""

from __future__ import annotations

import io
import os
import pickle
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

METADATA = ".metadata"
_DCP = "torch.distributed.checkpoint"
_ALLOWED = {
    (f"{_DCP}.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )
} | {
    (f"{_DCP}.filesystem", "_StorageInfo"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
} | {(mod, cls) for mod in ("pathlib", "pathlib._local") for cls in ("PosixPath", "WindowsPath", "PurePosixPath",
                                                                    "PureWindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``Metadata``; refuses every class outside the allow-list (no code execution)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}: not part of DCP's metadata")
        return super().find_class(module, name)


def read_metadata_file(path: str) -> tuple[Metadata, int]:
    """DCP's ``Metadata`` from ``path`` via the allow-list unpickler, and the bytes read."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as e:  # any failure to parse is a broken or hostile file, reported alike
        raise ValueError(f"{path}: unreadable DCP metadata ({type(e).__name__}: {e})") from e
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{path}: holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata, len(data)


class CheckpointReader(FileSystemReader):
    """DCP's file reader with the safe metadata unpickler and a count of the bytes read."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self.metadata_bytes = 0
        self.data_bytes = 0

    @property
    def bytes_read(self) -> int:
        return self.metadata_bytes + self.data_bytes

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata, nbytes = read_metadata_file(os.path.join(str(self.path), METADATA))
        self.metadata_bytes += nbytes
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        # DCP reads each requested stored item whole, then narrows it: count what it reads.
        self.data_bytes += sum(self.storage_data[item.storage_index].length for item in plan.items)
        return super().read_data(plan, planner)


class SafeLoadPlanner(DefaultLoadPlanner):
    """Loads a *flat* state dict keyed by DCP's flattened keys; byte blobs via ``weights_only=True``.

    The raw bytes of every blob are kept in ``raw`` so they can be forwarded to other ranks, which then
    decode them with :func:`decode_object` themselves.
    """

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, allow_partial_load=False)
        self.raw: dict[str, bytes] = {}

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        self.raw[key] = value.getvalue()
        self.state_dict[key] = decode_object(self.raw[key], key)


def load_locally(state_dict: dict[str, Any], reader: CheckpointReader) -> SafeLoadPlanner:
    """DCP load of ``state_dict`` in this process alone (no collectives; used by rank 0 and by export)."""
    planner = SafeLoadPlanner()
    with warnings.catch_warnings():
        # DCP warns that it assumes a single process when told no_dist: that is the point here.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state_dict, storage_reader=reader, planner=planner, no_dist=True)
    return planner


def decode_object(raw: bytes, key: str) -> Any:
    """A non-tensor value stored by DCP (``torch.save``'d), rebuilt without running arbitrary code."""
    try:
        return torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as e:  # weights_only raises UnpicklingError for anything beyond plain data
        raise ValueError(f"checkpoint value {key!r} is not plain data and is not loaded ({type(e).__name__})") from e


@dataclass(frozen=True)
class Entry:
    """One leaf of a checkpoint: its path in the saved nested state dict, tensor shape/dtype or object."""

    key: str
    path: tuple[str | int, ...]
    is_tensor: bool
    shape: tuple[int, ...] = ()
    dtype: str = ""


def entries(metadata: Metadata) -> dict[str, Entry]:
    """Every leaf of a checkpoint by flattened key, with its nested path (``("optim", "state", fqn, name)``)."""
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    out = {}
    for key, md in metadata.state_dict_metadata.items():
        path = tuple(paths.get(key, tuple(key.split(".", 1))))
        if isinstance(md, TensorStorageMetadata):
            out[key] = Entry(key, path, True, tuple(md.size), str(md.properties.dtype).removeprefix("torch."))
        elif isinstance(md, BytesStorageMetadata):
            out[key] = Entry(key, path, False)
    return out


def check_storage(metadata: Metadata, sizes: dict[str, int], where: str) -> None:
    """Every stored item lies inside a file the manifest lists (no missing file, no out-of-range read)."""
    for index, info in metadata.storage_data.items():
        name = str(info.relative_path)
        if name not in sizes:
            raise ValueError(f"{where}: metadata references {name!r}, which the manifest does not list")
        if info.offset < 0 or info.length < 0 or info.offset + info.length > sizes[name]:
            raise ValueError(f"{where}: {index.fqn} lies outside {name} ({sizes[name]} bytes): truncated")


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r} in checkpoint metadata")
    return dtype

