"""Gradients that land after the backward returned: the step's last inter-node hops overlap the optimizer.

At 1 Gbit/s between nodes a step is link-bound: the hops of the last units to finish their backward queue
behind each other and end a few tenths of a second after the backward. Waiting for all of them there leaves the
optimizer nothing to overlap. Instead, where it is safe, the end of backward issues every hop and returns with
them in flight (:class:`LateGrads`); ``ShardedOptimizer.step`` then lands them in backward order and steps each
unit's parameters the moment their gradients are final, so the step of the first units runs under the last
units' hops.

Nothing else may see a gradient before it landed, and nothing does: while a tail is in flight, its parameters'
class carries a ``grad`` property (:func:`_late_class`) whose first read or write, from any code (torch's
``clip_grad_norm_``, a ``GradScaler``, ``zero_grad``, a user's logging), lands every gradient of the tail and
concludes the step as the end of backward would have, then answers from the landed gradient. The next forward
or backward, ``model.reshard()``, a checkpoint and a conversion land it too. Only hsdp's own code reads the raw
slot meanwhile (:func:`raw_grad`).

Safe means (``step_reductions.py`` decides): every hop was issued before the backward returned and waiting for
it issues no collective (a hop's ``waits_locally``), so the order of collectives is the same on every rank
wherever the landing happens; nothing is left for the conclusion that crosses ranks (no buffer broadcast due)
or that must be read before the step (no batch weight, every parameter had a gradient on this rank, so no
"unused" flag needs a host read); the replicate layer never discards the step (elastic steps are decided at
their end); and the hops carry the step's gradients (not DiLoCo, not an unsynced micro-batch). Elsewhere the
backward waits for its hops as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

_GRAD = torch._C.TensorBase.grad  # the tensor's own gradient slot, under any subclass's ``grad`` property


def raw_grad(param: torch.Tensor) -> torch.Tensor | None:
    """``param.grad`` without landing a tail in flight (hsdp's own bookkeeping only)."""
    return _GRAD.__get__(param)


def set_raw_grad(param: torch.Tensor, grad: torch.Tensor | None) -> None:
    """``param.grad = grad`` without landing a tail in flight (hsdp's own bookkeeping only)."""
    _GRAD.__set__(param, grad)


class Reduction(Protocol):
    """What a late gradient's reduction offers (``reduction.Reduction``, which imports this module)."""

    params: list[Any]  # its ShardedParams: ``.sharded`` is the nn.Parameter

    def finish(self) -> None: ...

    def abandon(self, quiet: bool = False) -> None: ...


class LateGrads:
    """One backward's reductions whose hops are in flight (module docstring), landed in backward order."""

    def __init__(self, reductions: list[Reduction], conclude: Callable[[list[Reduction]], None]) -> None:
        self._queue = list(reductions)
        self._landed: list[Reduction] = []
        self._conclude = conclude
        last = {id(p.sharded): i for i, r in enumerate(reductions) for p in r.params}
        # Which parameters each landing makes final: a unit reduced twice in one backward lands at its second.
        self._final = [[p.sharded for p in r.params if last[id(p.sharded)] == i] for i, r in enumerate(reductions)]
        self._params = list({id(p.sharded): p.sharded for r in reductions for p in r.params}.values())
        for param in self._params:
            param._hsdp_late = self
            param.__class__ = _late_class(type(param))

    @property
    def pending(self) -> bool:
        return bool(self._queue)

    def land_next(self) -> list[torch.Tensor]:
        """Wait for the next reduction's hop and hand its gradients over; the parameters whose gradients are now
        final (their sharded ``nn.Parameter``). After the last one the step is concluded (buffers, host read)."""
        reduction = self._queue.pop(0)
        try:
            reduction.finish()
        except BaseException:
            self._drop_rest()
            raise
        self._landed.append(reduction)
        final = self._final[len(self._landed) - 1]
        if not self._queue:
            self._restore()
            self._conclude(self._landed)
        return final

    def land_all(self) -> None:
        while self._queue:
            self.land_next()

    def _drop_rest(self) -> None:
        """A hop failed: the others are waited for and dropped, the parameters are plain again."""
        queue, self._queue = self._queue, []
        for reduction in queue:
            reduction.abandon(quiet=True)
        self._restore()

    def _restore(self) -> None:
        for param in self._params:
            param.__class__ = _plain_class(type(param))
            param._hsdp_late = None


class _LandsOnRead:
    """Mixed into a parameter's class while its gradient is late: any ``grad`` access lands the tail first."""

    __slots__ = ()

    @property
    def grad(self) -> Any:
        self._hsdp_late.land_all()  # type: ignore[attr-defined]
        return _GRAD.__get__(self)

    @grad.setter
    def grad(self, value: Any) -> None:
        self._hsdp_late.land_all()  # type: ignore[attr-defined]
        _GRAD.__set__(self, value)

    # A copy or a pickle names the class: the plain one, once landed (the late class is nowhere to import).
    def __reduce_ex__(self, protocol: Any) -> Any:
        self._hsdp_late.land_all()  # type: ignore[attr-defined]
        return self.__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict) -> Any:
        self._hsdp_late.land_all()  # type: ignore[attr-defined]
        return self.__deepcopy__(memo)


_LATE_CLASSES: dict[type, type] = {}


def _late_class(cls: type) -> type:
    """``cls`` with :class:`_LandsOnRead` first (cached, so the class of a late ``DTensor`` is one class).
    No new slots: a tensor's ``__class__`` can only be swapped between classes of the same layout."""
    if cls not in _LATE_CLASSES:
        _LATE_CLASSES[cls] = type(f"Late{cls.__name__}", (_LandsOnRead, cls), {"__slots__": ()})
    return _LATE_CLASSES[cls]


def _plain_class(cls: type) -> type:
    return cls.__mro__[2] if issubclass(cls, _LandsOnRead) else cls
