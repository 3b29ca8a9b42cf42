"""The side-by-side benchmark (``hsdp bench``): hsdp against FSDP2 and DDP on the same work."""
