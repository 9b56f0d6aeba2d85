"""Fixtures shared by the end-to-end tests."""

from .probes import _reap_probes

__all__ = ["_reap_probes"]
