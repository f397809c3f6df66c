"""How the HAL declares an op: once, on :class:`~ngram_hal.backend.Backend`'s public method.

:func:`declare` decorates the method with the op's declaration (its arguments and their kinds, tied
sizes, outputs, the arguments it writes and the value rules strict mode checks); the method's body
is the check it runs before and after the backend's ``_<name>``. :func:`declarations` collects them
in the order the class defines them. Everything that lists ops derives from that:
:data:`ngram_hal.backend.OPS`, the conformance suite's argument tables and its timed ops, and the
op reference ``docs/ops.md`` (:func:`ops_markdown`). A declaration whose argument names differ
from its method's parameters fails when the class is defined.

Argument kinds: ``index`` (an int64 tensor), ``mask`` (a bool tensor), ``float`` (a float
tensor), ``kv`` (a :class:`~ngram_hal.kv_cache.KVCache`), ``int`` (a host int), ``scalar`` (a host
float), ``flag`` (a host bool), ``layout`` (an :class:`~ngram_hal.layout.AttentionLayout`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

TENSOR_KINDS = ("index", "mask", "float")
KINDS = (*TENSOR_KINDS, "kv", "int", "scalar", "flag", "layout")


@dataclass(frozen=True)
class Arg:
    """One argument: its name, kind and whether its size is tied to an earlier tensor's (a
    mismatch raises ``ContractError`` naming it)."""

    name: str
    kind: str
    tied: bool = False


@dataclass(frozen=True)
class OpDecl:
    """One op of the HAL.

    Attributes:
        name: the op, and the :class:`~ngram_hal.backend.Backend` method that runs it (its
            implementation is ``_<name>``).
        args: the method's arguments, in order.
        outputs: what it returns, in order (empty: it writes in place).
        writes: the arguments it writes in place; every other argument is read only.
        summary: what it does, in one line.
        rules: the value rules strict mode checks (reading data, a host sync), in words.
        builder: for an op whose work split is built first (attention), the builder method's
            name and arguments.
    """

    name: str
    args: tuple[Arg, ...]
    outputs: tuple[str, ...]
    summary: str
    rules: tuple[str, ...]
    builder: tuple[str, tuple[Arg, ...]] | None = None
    writes: tuple[str, ...] = ()

    def methods(self) -> dict[str, tuple[Arg, ...]]:
        """The public methods of the op (the builder first, where there is one) and their arguments."""
        first = {self.builder[0]: self.builder[1]} if self.builder else {}
        return {**first, self.name: self.args}


def _parse(fn, spec: str) -> tuple[Arg, ...]:
    """``"name:kind, name:kind=, ..."`` (``=`` marks a tied size) as :class:`Arg` s, checked
    against ``fn``'s parameters (after ``self``)."""
    args = []
    for item in spec.split(","):
        name, kind = item.strip().split(":")
        args.append(Arg(name, kind.rstrip("="), kind.endswith("=")))
    params = list(inspect.signature(fn).parameters)[1:]
    if params != [a.name for a in args]:
        raise TypeError(f"the declaration of {fn.__name__} names {[a.name for a in args]}, the method takes {params}")
    unknown = [a.kind for a in args if a.kind not in KINDS]
    if unknown:
        raise TypeError(f"the declaration of {fn.__name__} uses unknown kinds {unknown}")
    return tuple(args)


def declare(args: str, outputs: tuple[str, ...] = (), *, summary: str, rules: tuple[str, ...],
       writes: tuple[str, ...] = ()):
    """Declare the decorated public method as an op of the same name (see :class:`OpDecl`)."""
    def mark(fn):
        fn.declaration = OpDecl(fn.__name__, _parse(fn, args), tuple(outputs), summary, tuple(rules),
                                writes=tuple(writes))
        return fn
    return mark


def declare_builder(of: str, args: str):
    """Declare the decorated method as the builder of op ``of``'s work split, taking ``args``."""
    def mark(fn):
        fn.builds = (of, (fn.__name__, _parse(fn, args)))
        return fn
    return mark


def declarations(cls: type) -> tuple[OpDecl, ...]:
    """The ops ``cls`` declares, in definition order, each with its builder attached."""
    members = list(vars(cls).values())
    builders = dict(m.builds for m in members if hasattr(m, "builds"))
    return tuple(OpDecl(**{**vars(m.declaration), "builder": builders.get(m.declaration.name)})
                 for m in members if hasattr(m, "declaration"))


def ops_markdown(decls: tuple[OpDecl, ...]) -> str:
    """The op reference (``docs/ops.md``), made from the declarations."""
    lines = ["# The HAL's ops", "",
             "Made from the declarations on `ngram_hal/backend.py` by `make docs-ops`; `Backend`'s docstrings give",
             "the shapes. A tied argument (`=`) must match the size of the tensors before it. An op writes only the",
             "arguments its row names; every other argument is read only (the contract tier checks it).", "",
             "Adding an op touches six files: its declaration and checks (`@declare` on a new `Backend` method),",
             "the reference's function and `_<op>` binding in the group's module (`reference/kv.py`, ...), the",
             "Triton kernel and its binding (`kernels/triton/kv.py`, ...), the NPU backend's (`ngram_hal_npu/kv.py`,",
             "...), one conformance test module (its tests, `@cases.minimal_call` and `@cases.timed_call`), and",
             "this page (`make docs-ops`).", "",
             "| op | arguments | returns | strict value rules |", "|---|---|---|---|"]
    for decl in decls:
        for method, args in decl.methods().items():
            listed = ", ".join(f"`{a.name}`{'=' if a.tied else ''} {a.kind}" for a in args)
            if method != decl.name:
                lines.append(f"| `{method}` | {listed} | the layout `{decl.name}` reads | |")
                continue
            returns = ", ".join(f"`{o}`" for o in decl.outputs) or f"nothing (writes `{', '.join(decl.writes)}`)"
            lines.append(f"| `{method}`: {decl.summary} | {listed} | {returns} | {'; '.join(decl.rules)} |")
    return "\n".join(lines) + "\n"
