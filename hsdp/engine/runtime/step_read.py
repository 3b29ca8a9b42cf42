"""The training step's one host read: when it happens, and what rides on it.

On CUDA every read of a tensor's value on the host waits for the device and stops the host's run-ahead, so a
step makes at most one, and usually none:

* at the end of a backward, the "has gradient" flags (``reduction.drop_unused_grads``), read only where some
  parameter had no gradient on this rank: only then can the host not know whether another rank used it
  (DDP's ``grad = None`` for parameters no rank used). Where every parameter had one, every reduced flag is
  positive and nothing is read;
* else, just before the optimizer steps (torch's step pre-hook, for any optimizer, and
  ``ShardedOptimizer.step``), the *deferred values*, if any: checks that can wait until then, such as
  ``hsdp.clip_grad_norm_``'s non-finite warning and the batch weights' agreement. They go with the flags when
  those are read, and wait for the next read when the flags were read already this step.

The batch weights' check (``batch_weight.py``) is queued where this rank weighted its batch; where it did not,
it is only read with a read that happens anyway, so that unweighted training never reads for it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from torch.optim.optimizer import register_optimizer_step_pre_hook

from hsdp.engine.runtime.batch_weight import Weight, agreement, check_agreement
from hsdp.engine.runtime.reduction import DeferredRead, Reduction, drop_unused_grads


class StepRead:
    """The host read of one model's training step (see the module docstring)."""

    def __init__(self) -> None:
        self.deferred: list[DeferredRead] = []  # values read with the next host read
        self._read_this_step = False  # a backward since the last optimizer step read the flags
        self._agreement: DeferredRead | None = None  # the weights' check on an unweighted rank
        # Why only a ShardedOptimizer may step ("" = any may): it applies an elastic step only once committed,
        # and runs DiLoCo's outer step.
        self.sharded_optimizer_only = ""
        hook = register_optimizer_step_pre_hook(_before_any_step(self))
        weakref.finalize(self, hook.remove)

    def defer(self, value: Any, callback: Callable[[float], None]) -> None:
        """Read 1-element tensor ``value`` with the step's host read and hand it to ``callback``."""
        self.deferred.append((value, callback))

    def after_backward(self, reductions: list[Reduction], weight: Weight | None) -> None:
        """Every reduction of a backward finished: queue the weights' check, read the flags if needed."""
        synced = next((r for r in reductions if r.flags is not None), None)
        check = None if synced is None else (agreement(synced.output), check_agreement(weight is not None))
        self._agreement = None
        if check is not None and weight is not None:
            self.deferred.append(check)
        else:
            self._agreement = check
        if any(r.missing for r in reductions):
            drop_unused_grads(reductions, self._with_agreement())
            self._read_this_step = True

    def before_step(self) -> None:
        """Before an optimizer step: read the deferred values unless this step read the flags already (they then
        wait for the next read): at most one host read per step either way."""
        if self.deferred and not self._read_this_step:
            drop_unused_grads([], self._with_agreement())
        self._read_this_step = False
        self._agreement = None

    def _with_agreement(self) -> list[DeferredRead]:
        if self._agreement is not None:
            self.deferred.append(self._agreement)
            self._agreement = None
        return self.deferred


def _before_any_step(read: StepRead) -> Callable[..., None]:
    """A torch optimizer step pre-hook running ``read.before_step``, holding ``read`` weakly."""
    ref = weakref.ref(read)

    def hook(optimizer: object, *_: object) -> None:
        live = ref()
        if live is None:
            return
        if live.sharded_optimizer_only and getattr(optimizer, "_hsdp_model", None) is None and any(
                getattr(p, "_hsdp_sharded", False) for g in optimizer.param_groups for p in g["params"]):
            raise ValueError(f"{type(optimizer).__name__} steps the parameters of a model that "
                             f"{live.sharded_optimizer_only} directly: wrap it, "
                             f"optimizer = hsdp.ShardedOptimizer(model, optimizer)")
        live.before_step()
    return hook
