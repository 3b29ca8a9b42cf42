"""The checkpoint's error type: what every rank raises when saving or loading fails on any of them (see
:mod:`hsdp.engine.agreement` for how the ranks agree on it)."""


class CheckpointError(ValueError):
    """Saving or loading a checkpoint failed; raised on every rank with the same message.

    A ``ValueError`` because most causes are inputs (a path, a checkpoint of another model); the message
    names the problem and, where there is one, the fix.
    """
