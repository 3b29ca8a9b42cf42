"""``manifest.json``: what a complete checkpoint holds, with the size and SHA-256 of every file.

Rank 0 writes the manifest last, after every rank finished writing and the files were hashed, and just
before the directory gets its final name. A directory whose manifest is missing, unparsable, or whose
files disagree with it in size (truncation) or digest (corruption) is not a valid checkpoint.

Besides the file table the manifest records what loading needs to check a checkpoint against a model
without reading tensors: the step, the mesh it was saved on, the optimizer class and tied parameter
names.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

MANIFEST = "manifest.json"
FORMAT = "hsdp-checkpoint"
VERSION = 1
_CHUNK = 4 << 20


class InvalidCheckpoint(ValueError):
    """A directory is not a complete, intact checkpoint; the message says which file and why."""


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """The committed content of one checkpoint directory."""

    step: int
    world_size: int
    mesh: tuple[int, int]  # (replicas, replica 0's shard degree)
    files: dict[str, FileEntry]
    optimizer: str | None = None
    # alias name -> the name the parameter is stored under first (tied weights).
    tied: dict[str, str] = field(default_factory=dict)
    # Every replica's shard degree (they differ on a heterogeneous mesh); empty in manifests of older hsdp.
    sharding_degrees: tuple[int, ...] = ()

    def to_json(self) -> bytes:
        body = {
            "format": FORMAT, "version": VERSION, "step": self.step, "world_size": self.world_size,
            "mesh": list(self.mesh), "sharding_degrees": list(self.sharding_degrees), "optimizer": self.optimizer,
            "tied": self.tied,
            "files": {name: {"size": e.size, "sha256": e.sha256} for name, e in sorted(self.files.items())},
        }
        return json.dumps(body, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        try:
            body = json.loads(data)
            if body.get("format") != FORMAT:
                raise InvalidCheckpoint(f"{where}: not an hsdp manifest (format={body.get('format')!r})")
            if body.get("version") != VERSION:
                raise InvalidCheckpoint(
                    f"{where}: manifest version {body.get('version')} is not supported (this hsdp reads "
                    f"{VERSION}): load it with the hsdp version that wrote it"
                )
            files = {str(k): FileEntry(int(v["size"]), str(v["sha256"])) for k, v in body["files"].items()}
            return cls(int(body["step"]), int(body["world_size"]), (int(body["mesh"][0]), int(body["mesh"][1])),
                       files, body.get("optimizer"), {str(k): str(v) for k, v in body.get("tied", {}).items()},
                       tuple(int(d) for d in body.get("sharding_degrees", ())))
        except InvalidCheckpoint:
            raise
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            raise InvalidCheckpoint(f"{where}: corrupted manifest ({type(e).__name__}: {e})") from e


def hash_file(path: str) -> tuple[FileEntry, int]:
    """Size and SHA-256 of a file, and the bytes read to compute them."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return FileEntry(size, digest.hexdigest()), size


def read_manifest(ckpt_dir: str) -> tuple[Manifest, int]:
    """The manifest of ``ckpt_dir`` and its size in bytes; ``InvalidCheckpoint`` when absent or broken."""
    path = os.path.join(ckpt_dir, MANIFEST)
    try:
        with open(path, "rb") as f:
            data = f.read(64 << 20)
    except FileNotFoundError as e:
        raise InvalidCheckpoint(f"{ckpt_dir}: no {MANIFEST} (an interrupted save or not an hsdp checkpoint)") from e
    except OSError as e:
        raise InvalidCheckpoint(f"{ckpt_dir}: cannot read {MANIFEST}: {e}") from e
    return Manifest.from_json(data, path), len(data)


def check_sizes(ckpt_dir: str, manifest: Manifest) -> None:
    """Every listed file exists with its recorded size (cheap: ``stat`` only)."""
    for name, entry in sorted(manifest.files.items()):
        path = os.path.join(ckpt_dir, name)
        try:
            size = os.stat(path).st_size
        except OSError as e:
            raise InvalidCheckpoint(f"{ckpt_dir}: {name} is missing ({e.strerror})") from e
        if size != entry.size:
            raise InvalidCheckpoint(
                f"{ckpt_dir}: {name} is {size} bytes but the manifest says {entry.size} (truncated or overwritten)"
            )


def verify_checksums(ckpt_dir: str, manifest: Manifest, names: list[str]) -> int:
    """Re-hash ``names`` (a subset of the manifest's files) and compare; returns the bytes read."""
    total = 0
    for name in names:
        entry, nbytes = hash_file(os.path.join(ckpt_dir, name))
        total += nbytes
        if entry != manifest.files[name]:
            raise InvalidCheckpoint(
                f"{ckpt_dir}: {name} does not match its manifest checksum (corrupted: {entry.size} bytes, "
                f"sha256 {entry.sha256[:12]}..., expected {manifest.files[name].sha256[:12]}...)"
            )
    return total

