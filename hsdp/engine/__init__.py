"""The sharding engine: everything a training script needs to shard a model, and nothing above it.

Layering (checked by `lint-imports`, see pyproject.toml): ``hsdp.engine`` imports only torch and itself;
``hsdp.checkpoint``, ``hsdp.data`` and ``hsdp.models`` are libraries on the engine; ``hsdp.tools`` (launch,
planner, bench) and ``hsdp.apps`` (train, demo, cli) sit above them. Users import the public names from
``hsdp`` itself.
"""
