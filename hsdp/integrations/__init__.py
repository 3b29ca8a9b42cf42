"""hsdp inside the training frameworks people already use.

* :mod:`hsdp.integrations.accelerate`: ``prepare(accelerator, model, optimizer, ...)``, an hsdp model in
  ``accelerate.Accelerator`` (no DDP wrap; ``save_state``/``load_state`` through hsdp's sharded checkpoints).
* :mod:`hsdp.integrations.transformers`: ``HSDPTrainer``, a drop-in for ``transformers.Trainer`` (hsdp
  checkpoints inside Trainer's, exact resume).
* :mod:`hsdp.integrations.hf_folder`: ``save_pretrained(model, dir)``, a ShardedModel as a Hugging Face folder,
  every rank taking part (used by both of the above); a wrapped model's own ``model.save_pretrained(dir)`` is it.
* :mod:`hsdp.integrations.peft`: a wrapped PEFT model's ``save_pretrained(dir)`` writes the adapter alone, every
  rank taking part.
* :mod:`hsdp.integrations.lightning`: ``HSDPStrategy`` for Lightning's ``Trainer``, ``HSDPFabricStrategy`` for
  ``Fabric`` (Lightning checkpoints as hsdp checkpoints; ``bf16-mixed`` as ``hsdp.MixedPrecision``).

Each module imports its framework on import and is an optional extra (``pip install 'hsdp[hf]'``,
``'hsdp[peft]'``, ``'hsdp[lightning]'``); ``import hsdp`` never imports them.
"""
