"""Tools built on the engine: the launcher and emulated cluster, the planner, the benchmark harness."""
