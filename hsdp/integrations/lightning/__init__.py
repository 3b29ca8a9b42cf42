"""hsdp inside Lightning: ``HSDPStrategy`` for ``lightning.pytorch.Trainer``, ``HSDPFabricStrategy`` for
``lightning.fabric.Fabric`` (Lightning's Trainer and Fabric take strategies of two unrelated base classes,
as its own two ``FSDPStrategy`` classes show; both take the same arguments)::

    from hsdp.integrations.lightning import HSDPFabricStrategy, HSDPStrategy

    trainer = L.Trainer(strategy=HSDPStrategy(sharding_degree=2), precision="bf16-mixed")
    fabric = L.Fabric(strategy=HSDPFabricStrategy(sharding_degree=2), precision="bf16-mixed")

Launch with ``torchrun`` (or ``hsdp launch``): Lightning launches no process. Modules:

* :mod:`.trainer`, :mod:`.fabric`: the strategies;
* :mod:`.shared`: what both share (processes, mesh, sampler, Lightning's collectives);
* :mod:`.options`: hsdp's settings, checked when the strategy is built; the mesh; the wrap;
* :mod:`.environment`: the processes torchrun started;
* :mod:`.precision`: ``precision="bf16-mixed"`` as ``hsdp.MixedPrecision``; other flags refused;
* :mod:`.checkpoint`: Lightning checkpoints as hsdp checkpoints with Lightning's state inside.
"""

from hsdp.integrations.lightning.fabric import HSDPFabricStrategy
from hsdp.integrations.lightning.precision import HSDPFabricPrecision, HSDPPrecision
from hsdp.integrations.lightning.trainer import HSDPStrategy

__all__ = ["HSDPFabricPrecision", "HSDPFabricStrategy", "HSDPPrecision", "HSDPStrategy"]
