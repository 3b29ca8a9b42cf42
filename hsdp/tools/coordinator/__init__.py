"""The elastic coordinator service (``hsdp coordinator``)."""
