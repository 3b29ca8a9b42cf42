"""Elastic replicas: replica groups that leave and rejoin between steps (``docs/design/elastic.md``)."""
