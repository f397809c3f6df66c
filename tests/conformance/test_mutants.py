"""The mutation corpus: the conformance suite catches every planted-fault backend of
``tests/mutants.py`` by name.

Each mutant runs, in this process through ``pytest.main``, against the tests that must catch it
in every strict mode where its fault applies, plus its op's registration test as a control (a
mutant that broke every call would prove nothing about the named tests). The named tests must
fail or error, the control must pass. These runs pass ``--max-examples 10`` with a fixed
hypothesis seed, so they are cheap and repeatable.

With ``NGRAM_HAL_MUTANTS_FULL=1`` each mutant instead runs the whole suite as a vendor's ordinary
run does: every test, the default example count (25), a random hypothesis seed. The same named
tests must fail; this takes 30 to 90 s per mutant on 2 cores (about 50 min for the corpus with -n 2).
"""

from __future__ import annotations

import os

import pytest
from mutants import FAULTS, MODEL_KERNELS, Mutant, mutants
from suite_runs import failures, outcomes, run_suite

from ngram_hal.backend import OPS
from ngram_hal_conformance.plugin import DEFAULT_MAX_EXAMPLES

FULL_ENV = "NGRAM_HAL_MUTANTS_FULL"
FULL = os.environ.get(FULL_ENV, "").strip().lower() in {"1", "true", "yes", "on"}
# The fault classes every corpus must cover.
REQUIRED_FAULTS = {"wrong dtype out", "off-by-one at page boundaries", "sentinel mishandled",
                   "sequential instead of parallel moves", "partial writes", "state changed before an error",
                   "mask ignored", "wrong GQA head map", "greedy/sampling confusion", "bonus-token errors",
                   "silent repair of bad input", "narrowed to 32 bits", "an input used as scratch",
                   "stops short at scale", "subnormals flushed", "signed zero lost", "softmax overflow",
                   "half-precision accumulation", "wrong layer read"}


def in_mode(test_id: str, mode: str) -> str:
    """The stable id of ``test_id`` (written without its strict mode) run with strict ``mode``."""
    name, _, params = test_id.partition("[")
    return f"{name}[strict-{mode}-{params}" if params else f"{name}[strict-{mode}]"


def node_id(stable: str) -> str:
    """The ``--pyargs`` node id of a stable test id: ``test_kv.py::t[p]`` -> ``ngram_hal_conformance.test_kv::t[p]``."""
    path, _, test = stable.partition("::")
    return f"ngram_hal_conformance.{path.removesuffix('.py')}::{test}"


def test_corpus_covers_every_op_and_fault_class():
    corpus = mutants()
    assert len(corpus) >= 60, f"{len(corpus)} mutants"
    assert sorted({m.op for m in corpus}) == sorted((*OPS, *MODEL_KERNELS))
    assert REQUIRED_FAULTS <= {m.fault for m in corpus}, REQUIRED_FAULTS - {m.fault for m in corpus}
    for m in corpus:
        assert m.fault in FAULTS and m.op in (*OPS, *MODEL_KERNELS) and m.caught_by and m.__doc__, m.__name__
        assert set(m.modes) <= {"on", "off"} and m.modes, m.__name__


@pytest.mark.parametrize("mutant", mutants(), ids=lambda m: m.__name__)
def test_mutant_is_caught(tmp_path, monkeypatch, mutant: type[Mutant]):
    caught = {in_mode(t, mode) for t in mutant.caught_by for mode in mutant.modes}
    # The control runs where its fault is not reported at run time: strict mode checks every
    # output, so there even a valid call of a mutant with a bad output fails.
    control_mode = "off" if "off" in mutant.modes else "on"
    control = {in_mode(mutant.control or f"test_registration.py::test_op_present[{mutant.op}]", control_mode)} - caught
    strict = "both" if len(mutant.modes) == 2 else mutant.modes[0]
    if FULL:
        examples, modules = ("--max-examples", str(DEFAULT_MAX_EXAMPLES)), ("ngram_hal_conformance",)
    else:
        examples = ("--max-examples", "10", "--hypothesis-seed", "0")
        modules = tuple(node_id(t) for t in sorted(caught | control))
    rc, report = run_suite(tmp_path, monkeypatch, f"mutants:{mutant.__name__}", "--strict-mode", strict, *examples,
                           modules=modules)
    assert report is not None, f"no report (exit code {rc})"
    got = outcomes(report)
    survived = {t: got.get(t, "not run") for t in sorted(caught) if got.get(t) not in ("failed", "error")}
    assert not survived, f"{mutant.__name__} ({mutant.fault}) survived: {survived}"
    broken = {t: got.get(t, "not run") for t in sorted(control) if got.get(t) != "passed"}
    assert not broken, f"{mutant.__name__}: the control failed, so it proves nothing: {broken}\n{failures(report)}"
