"""The layers point down only, and no modules import each other in a cycle; the tests are grouped
by the layer they test and read no private names.

Every import of the core package, the backend packages and the conformance suite is read from the
source (module level and inside functions alike; imports made only for type annotations, under
``if TYPE_CHECKING:``, do not count) and checked against :data:`LAYERS`, bottom first: a module
may import its own layer and the layers below it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"ngram_hal": ROOT / "ngram_hal", "ngram_hal_cuda": ROOT / "backends/cuda/ngram_hal_cuda",
            "ngram_hal_rocm": ROOT / "backends/rocm/ngram_hal_rocm",
            "ngram_hal_npu": ROOT / "backends/npu/ngram_hal_npu",
            "ngram_hal_conformance": ROOT / "conformance/ngram_hal_conformance"}

# (layer, module prefixes), bottom first; a module belongs to the layer of its longest prefix.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("contract types", ("ngram_hal.contract", "ngram_hal.declarations", "ngram_hal.kv_cache", "ngram_hal.layout",
                        "ngram_hal.files", "ngram_hal.options", "ngram_hal.report_schema")),
    ("hal", ("ngram_hal", "ngram_hal.backend", "ngram_hal.model_kernels", "ngram_hal.runtime", "ngram_hal.registry",
             "ngram_hal.proxy")),
    ("backends", ("ngram_hal.reference", "ngram_hal.kernels", "ngram_hal_cuda", "ngram_hal_rocm", "ngram_hal_npu")),
    ("speculative core", ("ngram_hal.memory", "ngram_hal.speculative")),
    ("engine", ("ngram_hal.engine",)),
    ("cli", ("ngram_hal.cli", "ngram_hal.matrix")),
    ("conformance suite", ("ngram_hal_conformance",)),
]


def module_files() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of :data:`PACKAGES`."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = (package, *path.relative_to(folder).with_suffix("").parts)
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = module_files()


def layer_of(module: str) -> int:
    best = max(((len(prefix), rank) for rank, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
                if module == prefix or module.startswith(prefix + ".")), default=None)
    if best is None:
        raise AssertionError(f"module {module} is in no layer of LAYERS")
    return best[1]


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:``."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            skip |= {id(inner) for stmt in node.body for inner in ast.walk(stmt)}
    return skip


def imports_of(module: str) -> set[str]:
    """The modules of :data:`MODULES` that ``module`` imports (``from pkg import mod`` names mod)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _type_checking_nodes(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            named = [f"{source}.{alias.name}" for alias in node.names if f"{source}.{alias.name}" in MODULES]
            targets = named or [source]
        else:
            continue
        out |= {t for t in targets if t in MODULES and t != module}
    return out


GRAPH = {m: imports_of(m) for m in MODULES}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    mine = layer_of(module)
    up = sorted(t for t in GRAPH[module] if layer_of(t) > mine)
    assert not up, (f"{module} ({LAYERS[mine][0]}) imports a layer above it: "
                    + ", ".join(f"{t} ({LAYERS[layer_of(t)][0]})" for t in up))


@pytest.mark.parametrize("module", sorted(m for m in MODULES if LAYERS[layer_of(m)][0] in ("speculative core", "engine")))
def test_the_core_reaches_the_hardware_only_through_the_hal(module):
    """The speculative core and the engine import no backend and no kernel: they reach the
    hardware through the ``Backend`` interface (its ops, ``layer_kernels``, ``lookup_kernel``)."""
    backends = [rank for rank, (name, _) in enumerate(LAYERS) if name == "backends"]
    direct = sorted(t for t in GRAPH[module] if layer_of(t) in backends)
    assert not direct, f"{module} imports backend modules: {', '.join(direct)}"


def test_no_import_cycles():
    """No strongly connected set of modules (Tarjan's algorithm over the import graph)."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not cycles, f"modules that import each other: {cycles}"


def test_the_checker_sees_a_back_arrow():
    """The rules catch what they are for: the contract layer importing the HAL would fail."""
    assert layer_of("ngram_hal.kv_cache") < layer_of("ngram_hal.backend") < layer_of("ngram_hal.kernels.triton.kv")
    assert "ngram_hal.kv_cache" in GRAPH["ngram_hal.kernels.triton.kv"]


TESTS = ROOT / "tests"
# The folders of tests/, one per layer (the reference backend and the conformance suite's own
# machinery get theirs); only the checks that span the layers sit at the top.
TEST_FOLDERS = ("hal", "reference", "backends", "speculative", "engine", "cli", "conformance", "bench")
CROSS_LAYER_TESTS = ("test_layers.py", "test_ci_workflow.py")


def test_tests_are_grouped_by_layer():
    misplaced = [str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py")
                 if p.parent.name not in TEST_FOLDERS and not (p.parent == TESTS and p.name in CROSS_LAYER_TESTS)
                 and "thirdparty" not in p.parts]
    assert not misplaced, f"test modules outside the layer folders {TEST_FOLDERS}: {misplaced}"


def private_reads(source: str) -> list[str]:
    """Reads of a ``_name`` attribute of anything but ``self``, ``cls`` or ``super()`` (dunders
    allowed): a test that reaches into a module's or an object's private state."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            continue
        if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
            continue
        found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_no_test_reads_a_private_name():
    reads = {str(p.relative_to(TESTS)): found for p in sorted(TESTS.rglob("*.py"))
             if (found := private_reads(p.read_text(encoding="utf-8")))}
    assert not reads, f"tests reading private names: {reads}"
    assert private_reads("corpus._table.copy()\nsuper()._move_kv(kv, s, d)\nself._x = 1") == [
        "line 1: corpus._table"]

