"""Proxy runs: a backend's code run on a stand-in device (semantics, not the vendor's hardware).

A backend becomes available as a proxy only when its switch (``NGRAM_HAL_<NAME>_PROXY=1``) is set
and its native device is absent; it then reports ``proxy: true`` everywhere.
"""

from __future__ import annotations

import os
from collections.abc import Callable

TRUE_VALUES = {"1", "true", "yes", "on"}


def requested(env: str) -> bool:
    """True when the environment variable ``env`` is set to a true value (1, true, yes, on)."""
    return os.environ.get(env, "").strip().lower() in TRUE_VALUES


class ProxyFlag:
    """A backend class's ``proxy`` attribute, read at each access: the switch ``env`` is set and
    ``native()`` says the backend's own device is not there (a native device always runs natively)."""

    def __init__(self, env: str, native: Callable[[], bool]):
        self.env = env
        self.native = native

    def __get__(self, obj, owner) -> bool:
        return requested(self.env) and not self.native()
