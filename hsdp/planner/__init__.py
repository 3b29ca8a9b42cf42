"""Shard-degree planning: a cost model of hsdp's memory and step time, calibrated by measurement.

* :func:`make_plan` estimates every (replicate, shard) layout of a cluster and recommends one, with reasons;
* :mod:`hsdp.planner.calibrate` fits the model's constants to measured step times;
* ``hsdp plan`` and ``hsdp tune`` are the command lines (:mod:`hsdp.planner.cli`).

The cost model (``model``, ``cluster``, ``options``, ``memory``, ``comm``, ``cost``, ``plan``) is pure Python:
it needs neither torch nor a process group, so a 70B plan for 1024 GPUs takes milliseconds on a laptop.
"""

from hsdp.planner.cluster import ClusterSpec, valid_degrees
from hsdp.planner.cost import StepEstimate, estimate_step
from hsdp.planner.memory import MemoryEstimate, estimate_memory
from hsdp.planner.model import ComputeProfile, ModelSpec, TransformerShape, UnitSpec, transformer
from hsdp.planner.options import PRECISIONS, Layout, Precision, TrainOptions
from hsdp.planner.plan import LayoutEstimate, Plan, make_plan

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
