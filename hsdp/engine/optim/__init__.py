"""Optimizer steps on sharded parameters: `ShardedOptimizer` and the per-family step kernels it picks."""
