"""How the watchdog (``watchdog.py``) judges a rank dead or a collective hung: one frozen policy per mesh."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FaultPolicy:
    """``timeout``: seconds without a heartbeat before a rank is declared dead, and seconds a collective may
    wait for a late or mismatched rank before the job is ended as hung (hsdp's own collectives, and those of
    other libraries that some ranks call alone: ``hsdp.engine.faults.foreign``); ``interval``: beat period;
    ``detect_hangs``: whether to watch collectives at all (off: only dead ranks are caught);
    ``watch_launcher``: end the rank when its launcher dies (``hsdp.engine.faults.launcher``);
    ``lease_stale_after``: how old a run directory's lease may get before another job takes it over
    (``hsdp.checkpoint.lease``)."""

    timeout: float = 45.0
    interval: float = 1.0
    detect_hangs: bool = True
    watch_launcher: bool = True  # a rank whose launcher (torchrun agent, hsdp launch) died exits too
    lease_stale_after: float = 60.0  # a run-directory lease not renewed for this long may be taken over

    def __post_init__(self) -> None:
        if not 0 < self.interval < self.timeout:
            raise ValueError(f"need 0 < interval < timeout, got interval={self.interval}, timeout={self.timeout}")
