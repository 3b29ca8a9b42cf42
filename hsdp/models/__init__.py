"""Reference models for demos, tests and benchmarks."""

from hsdp.models.gpt import GPT, PRESETS, GPTConfig, preset

__all__ = ["GPT", "PRESETS", "GPTConfig", "preset"]
