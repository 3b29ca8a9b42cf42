"""Data for data-parallel training: per-replica samplers and the byte-level text corpus."""
