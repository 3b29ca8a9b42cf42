"""What ``hsdp train`` needs of a tokenizer: the protocols the corpus readers and the model adapters share.

Their own module, below both ``corpus.py`` and ``lm.py``, so that neither imports the other (the model adapters
hand a model's own tokenizer to the corpus readers).
"""

from __future__ import annotations

from typing import Any, Protocol


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Any) -> str: ...


class DocumentTokenizer(Tokenizer, Protocol):
    """A model's own tokenizer: ``encode_documents`` gives the ids of every document, each followed by the
    end-of-text token when the tokenizer has one; ``name`` describes it."""

    name: str

    def encode_documents(self, texts: list[str]) -> list[int]: ...
