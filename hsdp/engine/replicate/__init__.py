"""The replicate layer: what crosses replicas, and which of its modes combine (``combinations.py``)."""
