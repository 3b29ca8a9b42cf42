"""After an optimizer step on replica slices: the all-gathers across replicas that refresh each unit's shards.

Each unit's gather sends this replica's stepped slices (packed, in the parameter dtype) and receives every
replica's, then copies them into the unit's flat shard buffer (``replica_slice.unpack_slices``). They run in
the order the next forward gathers the units, so they overlap it: a unit's gather is waited for (settled)
just before its all-gather inside the node. At most ``limit`` are in flight, as forward prefetch keeps at
most two units gathered: each holds R packed slices of its unit (about its shard size), and starting every
unit's at once would hold a second copy of all the shards. Settling one starts the next queued.

Units are opaque keys here (anything with ``params``, ``sharded_flat``, ``comm`` and ``name``), so this module
sits below ``unit.py``, which calls :meth:`SliceGathers.settle` before any read of its shards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hsdp.engine.collectives import Handle
from hsdp.engine.runtime.piece_scatter import start_piece_gathers
from hsdp.engine.runtime.piece_slice import PieceSliceLayout
from hsdp.engine.runtime.replica_slice import SliceLayout, pack_own, packed_numel, unpack_slices
from hsdp.engine.runtime.sharded_param import ShardedParam

IN_FLIGHT = 2  # slice all-gathers running at once (each holds R packed slices of its unit)


@dataclass
class _Gather:
    handle: Handle
    received: torch.Tensor | None  # (R * packed_numel,): every replica's packed slices
    params: list[ShardedParam]
    land: Callable[[], None] | None = None  # replicas of different degrees: writes the parts into the chunks


def stepped_params(unit: Any) -> list[ShardedParam]:
    """The unit's parameters whose slices the optimizer steps (trainable, sliced across replicas)."""
    return [p for p in unit.params if p.slice is not None and p.requires_grad]


class SliceGathers:
    """The slice all-gathers of one model: queued after a step, at most ``limit`` in flight."""

    def __init__(self, limit: int = IN_FLIGHT) -> None:
        self.limit = limit
        self._queued: list[Any] = []  # units in the order the next forward needs them, not started yet
        self._in_flight: dict[int, tuple[Any, _Gather]] = {}

    def append(self, unit: Any) -> None:
        """Queue one more unit (whose slices were just stepped), started at once if fewer than ``limit`` run."""
        if stepped_params(unit) and unit not in self._queued and id(unit) not in self._in_flight:
            self._queued.append(unit)
            self._fill()

    def settle(self, unit: Any) -> None:
        """Finish ``unit``'s gather (starting it first if still queued): its shards are then current."""
        if unit in self._queued:
            self._queued.remove(unit)
            self._in_flight[id(unit)] = (unit, _start(unit))
        entry = self._in_flight.pop(id(unit), None)
        if entry is not None:
            _finish(unit, entry[1])
        self._fill()

    def settle_all(self) -> None:
        # Settling one starts the next queued: loop until nothing is in flight or queued, oldest first.
        while self._in_flight or self._queued:
            self.settle(next(iter(self._in_flight.values()))[0] if self._in_flight else self._queued[0])

    def _fill(self) -> None:
        while self._queued and len(self._in_flight) < self.limit:
            unit = self._queued.pop(0)
            self._in_flight[id(unit)] = (unit, _start(unit))


def _slices(params: list[ShardedParam]) -> list[SliceLayout]:
    return [p.slice for p in params]  # type: ignore[misc]


def _start(unit: Any) -> _Gather:
    params = stepped_params(unit)
    if isinstance(params[0].slice, PieceSliceLayout):  # replicas of different degrees: bucket by bucket
        handle, land = start_piece_gathers(unit, [p for p in params if not p.layout.replicated])
        return _Gather(handle, None, params, land)
    slices = _slices(params)
    mine = unit.sharded_flat.new_zeros(packed_numel(slices))
    pack_own([p.sharded_local for p in params], slices, mine)
    received = unit.sharded_flat.new_empty(unit.comm.size("replicate") * mine.numel())
    handle = unit.comm.all_gather(received, mine, "replicate", async_op=True, label=f"{unit.name} params")
    return _Gather(handle, received, params)


def _finish(unit: Any, gather: _Gather) -> None:
    gather.handle.wait()
    if gather.land is not None:
        gather.land()
        return
    assert gather.received is not None
    with torch.no_grad():
        unpack_slices(gather.received.view(unit.comm.size("replicate"), -1), _slices(gather.params),
                      [p.sharded_local for p in gather.params])
