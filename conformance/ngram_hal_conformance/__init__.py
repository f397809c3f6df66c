"""ngram-hal-conformance: the suite every ngram-hal backend runs.

``pytest --pyargs ngram_hal_conformance --backend NAME`` runs it against a registered backend
(or ``--backend module:Class``). Each test declares the op it covers and its tier (one of
``ngram_hal.report_schema.TIERS``) with ``@pytest.mark.conformance(op=..., tier=...)``; see the
package README.
"""

__version__ = "0.1.0"
