"""A fragment's sync between its start and its landing (``outer_step.py``): the all-reduce in flight
(:class:`PendingSync`) and what the sync sends, kept until it lands (:class:`Carried`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hsdp.engine.collectives import Handle


@dataclass
class PendingSync:
    """One fragment's pseudo-gradient all-reduce in flight: it lands once ``left`` inner steps have passed."""

    fragment: int
    left: int
    handles: list[Handle]
    sent: list[torch.Tensor]  # the all-reduced buffers (in the wire dtype), one per unit of the fragment
    weighted: bool = False  # each buffer ends with its replica's weight ([Note: pieces and weights])
    reduced: list[torch.Tensor] = field(default_factory=list)  # fp32 means, once waited (see settle)
    empty: bool = False  # weighted and every replica weighed 0: nothing to average (see settle)
    # Its transaction of the replicate layer is open (outer_transaction.py): closed where it lands. False for a
    # sync a checkpoint put back, already reduced. ``failed``: its start failed on this rank (nothing in flight);
    # ``residuals``: the int8 wire's before its start, which a discard puts back.
    opened: bool = False
    failed: bool = False
    residuals: dict | None = None
    voted: bool = False  # settled and voted on before its landing (OuterState._vote_reduced)

    def ready(self) -> bool:
        """Whether every all-reduce of the sync has ended here (never blocks)."""
        return bool(self.reduced) or all(handle.ready() for handle in self.handles)

    def settle(self) -> list[torch.Tensor]:
        """Wait for the all-reduces; the fp32 mean pseudo-gradients (weighted: divided by the mean weight)."""
        if not self.reduced:
            for handle in self.handles:
                handle.wait()
            self.reduced = [s if s.dtype == torch.float32 else s.float() for s in self.sent]
            if self.weighted:
                # Nobody contributed (an elastic job's start: every replica weighs 0): no outer update at all.
                self.empty = bool(torch.stack([r[-1] for r in self.reduced]).eq(0).all())  # one host read
                # A unit no backward reached on any replica weighs 0 (and moved by weight decay alone): keep it.
                self.reduced = [r[:-1].div_(r[-1].clamp_min(torch.finfo(r.dtype).tiny)) for r in self.reduced]
            self.handles, self.sent = [], []
        return self.reduced


@dataclass
class Carried:
    """A fragment's sync from its first start until it lands, so that a redo among the survivors
    (outer_transaction.py) sends the same: whether it sends weights, each unit's phase weight (taken once), and,
    where the layer can discard a sync, the buffers as first sent (``None`` elsewhere: nothing redoes it)."""

    weighted: bool
    weights: list[torch.Tensor]
    buffers: list[torch.Tensor] | None = None
