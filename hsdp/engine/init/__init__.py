"""Getting weights into a ShardedModel without a full copy per rank.

* ``materialize(model)``: a model built under ``torch.device("meta")`` and wrapped gets its shards
  allocated and initialised on every rank, one module at full size at a time (``meta.py``).
* ``load_pretrained(model, path)``: a ``.safetensors`` file or a Hugging Face folder read straight into
  the shards, each rank of replica 0 reading only its rows (``pretrained.py``).
* Converting a wrapped model (``.to``, ``.double()``, ``.to_empty``) keeps the shards consistent
  (``storage.py``, behind ``ShardedModel._apply``).
"""

from hsdp.engine.init.meta import materialize
from hsdp.engine.init.pretrained import load_pretrained

__all__ = ["load_pretrained", "materialize"]
