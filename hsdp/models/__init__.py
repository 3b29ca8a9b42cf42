"""Reference models for demos, tests and benchmarks, and sampling text from them."""

from hsdp.models.gpt import GPT, PRESETS, GPTConfig, preset
from hsdp.models.sampling import generate, sample_next

__all__ = ["GPT", "PRESETS", "GPTConfig", "generate", "preset", "sample_next"]
