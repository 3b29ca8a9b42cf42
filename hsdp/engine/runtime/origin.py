"""Which rank's chunk a DTensor holds, so that a chunk loaded on the wrong rank is refused, not trusted.

[Note: pickled chunks]
A DTensor pickles as its *local* tensor plus its mesh and placements; unpickling rebuilds the mesh around the
loading process, so the tensor then claims to be that process's chunk whatever rank wrote it. The generic save
paths of the frameworks do exactly this: rank 0 ``torch.save(model.state_dict())`` (Hugging Face Trainer,
accelerate's ``save_state(safe_serialization=False)``, a user's own loop), every rank ``torch.load`` +
``load_state_dict``. Each rank would then load rank 0's rows as its own shard, silently: FSDP2 does. hsdp
stamps every DTensor it hands out (parameters, ``state_dict()`` values, optimizer state) with the mesh
coordinates that decide which rows it holds (:class:`ChunkOrigin` as a tuple, kept through pickling, with
``weights_only=True`` too, in the tensor's ``__dict__``), and :func:`check_origin` refuses, on load, a stamped
DTensor whose coordinates are not this rank's. Ranks that hold the same rows (the same shard of another
replica) may load each other's chunks: that is correct. DTensors hsdp did not stamp (DCP's own, FSDP2's, and
the results of ops such as ``clone()`` or ``.cpu()``, which drop the stamp) are trusted as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

ORIGIN_ATTR = "_hsdp_origin"


@dataclass(frozen=True)
class ChunkOrigin:
    """The writer's global rank (for the message), its mesh's shape and its coordinate on each mesh dim the
    tensor is split over (``None`` on replicated dims, where every rank holds the same data)."""

    rank: int
    mesh_shape: tuple[int, ...]
    coords: tuple[int | None, ...]


def origin_of(value: DTensor, mesh: DeviceMesh | None = None) -> ChunkOrigin | None:
    """The chunk this process holds of a DTensor placed like ``value`` on ``mesh`` (default: its own mesh),
    or ``None`` off the mesh (a rank not in it)."""
    mesh = value.device_mesh if mesh is None else mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None or len(coordinate) != len(value.placements):
        return None  # off the mesh, or placed for another mesh (a slice state checked against a chunk's)
    coords = tuple(c if isinstance(p, Shard) else None for c, p in zip(coordinate, value.placements, strict=True))
    return ChunkOrigin(mesh.get_rank(), tuple(mesh.shape), coords)


def stamp(value: Any) -> Any:
    """Record on ``value`` (a DTensor this rank holds) which chunk it is; other values pass unchanged.
    A dict entry and a tensor attribute: no copy, no collective."""
    if isinstance(value, DTensor):
        origin = origin_of(value)
        # Kept as a tuple of ints: ``torch.load(weights_only=True)`` (torch's default) rebuilds no other type.
        setattr(value, ORIGIN_ATTR, None if origin is None else (origin.rank, origin.mesh_shape, origin.coords))
    return value


def check_origin(value: Any, mesh: DeviceMesh, what: str) -> None:
    """``ValueError`` naming the fix when ``value`` is a stamped DTensor holding rows other than those this
    rank holds on ``mesh`` (it was pickled by one rank and loaded by another). ``what`` names the entry
    (``"parameter 'fc.weight'"``). The coordinates come from ``mesh``, not from the value: an unpickled mesh
    keeps the writer's coordinate."""
    record = getattr(value, ORIGIN_ATTR, None) if isinstance(value, DTensor) else None
    if record is None:
        return
    written = ChunkOrigin(*record)
    here = origin_of(value, mesh)
    if here is None or (here.mesh_shape, here.coords) == (written.mesh_shape, written.coords):
        return
    raise ValueError(
        f"{what} holds the chunk of rank {written.rank} (mesh {written.mesh_shape}, coordinates "
        f"{_coords(written.coords)}), but this is rank {here.rank} (mesh {here.mesh_shape}, coordinates "
        f"{_coords(here.coords)}): the state dict was saved by one rank (e.g. torch.save(model.state_dict()) on rank "
        f"0 only) and holds only that rank's rows, so loading it here would corrupt the weights silently. Save "
        f"sharded state with hsdp.save_checkpoint / load it with hsdp.load_checkpoint (any mesh), or save "
        f"hsdp.full_state_dict(model) (consolidated, called on every rank) and load that full dict on every rank"
    )


def _coords(coords: tuple[int | None, ...]) -> str:
    return "(" + ", ".join("*" if c is None else str(c) for c in coords) + ")"
