"""ngram-hal-conformance: the suite every ngram-hal backend runs.

``pytest --pyargs ngram_hal_conformance --backend NAME`` runs it against a registered backend
(or ``--backend module:Class``). Each test declares the op it covers and its tier with
``@pytest.mark.conformance(op=..., tier=...)``; see the package README.
"""

__version__ = "0.1.0"

TIERS: tuple[str, ...] = ("registration", "contract", "semantics", "scale", "edge", "model", "engine", "performance")
"""Tiers in the order a backend usually clears them."""

REPORT_SCHEMA = "ngram-hal-conformance/1"
"""The ``schema`` field of every JSON report this version writes."""
