"""Each op is declared once, on its public method (``ngram_hal.declarations``); every bundled
backend implements what is declared, the lists derived from the declarations agree, and every op
has the calls the conformance tiers run."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from ngram_hal.backend import DECLARATIONS, OPS, Backend
from ngram_hal.declarations import TENSOR_KINDS, declare, ops_markdown
from ngram_hal.kernels.triton.ops import TritonHalOps
from ngram_hal.reference import CpuBackend
from ngram_hal_conformance import cases
from ngram_hal_npu.backend import NpuBackend

METHODS = [(method, args) for decl in DECLARATIONS for method, args in decl.methods().items()]


@pytest.mark.parametrize("method,args", METHODS, ids=[m for m, _ in METHODS])
def test_a_declaration_names_its_methods_arguments_in_order(method, args):
    params = list(inspect.signature(getattr(Backend, method)).parameters)[1:]
    assert params == [a.name for a in args], f"Backend.{method} takes {params}"
    assert all(a.kind in (*TENSOR_KINDS, "kv", "int", "scalar", "flag", "layout") for a in args)


def test_a_declaration_that_misnames_an_argument_fails_when_the_class_is_made():
    with pytest.raises(TypeError, match=r"names \['src', 'dst'\], the method takes \['src', 'dest'\]"):
        class Misdeclared(Backend):
            @declare("src:index, dst:index=", summary="", rules=())
            def copy(self, src, dest):
                return None


@pytest.mark.parametrize("backend", [CpuBackend, NpuBackend, TritonHalOps], ids=lambda b: b.__name__)
def test_every_bundled_backend_implements_every_declared_op(backend):
    missing = [m for m, _ in METHODS if m != "attention_layout" and not callable(getattr(backend, "_" + m, None))]
    assert not missing, f"{backend.__name__} lacks {missing}"


def test_the_op_list_and_the_suites_tables_come_from_the_declarations():
    assert OPS == tuple(d.name for d in DECLARATIONS) and len(set(OPS)) == len(OPS)
    assert set(cases.TENSOR_ARGS) == set(cases.TIED_ARGS) == {m for m, _ in METHODS}
    for method, args in METHODS:
        tensors = [a.name for a in args if a.kind in TENSOR_KINDS]
        assert list(cases.TENSOR_ARGS[method]) == tensors
        assert set(cases.TIED_ARGS[method]) <= set(tensors)


def test_every_op_registers_the_calls_the_conformance_tiers_run():
    minimal, timed = cases.registered_ops()
    assert minimal == {m for m, _ in METHODS}
    assert timed >= set(OPS) - {"attention"}


def test_the_op_reference_is_made_from_the_declarations():
    docs = Path(__file__).resolve().parents[2] / "docs" / "ops.md"
    assert docs.read_text(encoding="utf-8") == ops_markdown(DECLARATIONS), "run `make docs-ops` after changing a declaration"
    assert all(f"`{op}`" in docs.read_text(encoding="utf-8") for op in OPS)
