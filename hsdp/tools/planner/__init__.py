"""Shard-degree planning: a cost model of hsdp's memory and step time, calibrated by measurement.

* :func:`make_plan` estimates every (replicate, shard) layout of a cluster and recommends one, with reasons;
* :mod:`hsdp.tools.planner.diloco` estimates each layout under DiLoCo (weights synced every H steps, not DDP's
  math) next to plain HSDP;
* :mod:`hsdp.tools.planner.calibrate` fits the model's constants to measured step times;
* ``hsdp plan`` and ``hsdp tune`` are the command lines (:mod:`hsdp.apps.cli.plan`, :mod:`hsdp.apps.cli.tune`).

The cost model (``model``, ``cluster``, ``options``, ``memory``, ``comm``, ``cost``, ``plan``) is pure Python:
it needs neither torch nor a process group, so a 70B plan for 1024 GPUs takes milliseconds on a laptop.
"""

from hsdp.tools.planner.cluster import ClusterSpec, valid_degrees
from hsdp.tools.planner.cost import StepEstimate, estimate_step
from hsdp.tools.planner.memory import MemoryEstimate, estimate_memory
from hsdp.tools.planner.model import ComputeProfile, ModelSpec, TransformerShape, UnitSpec, transformer
from hsdp.tools.planner.options import PRECISIONS, Layout, Precision, TrainOptions
from hsdp.tools.planner.plan import LayoutEstimate, Plan, make_plan

__all__ = [
    "PRECISIONS",
    "ClusterSpec",
    "ComputeProfile",
    "Layout",
    "LayoutEstimate",
    "MemoryEstimate",
    "ModelSpec",
    "Plan",
    "Precision",
    "StepEstimate",
    "TrainOptions",
    "TransformerShape",
    "UnitSpec",
    "estimate_memory",
    "estimate_step",
    "make_plan",
    "transformer",
    "valid_degrees",
]
