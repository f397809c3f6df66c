"""ngram_hal.registry: entry-point discovery, auto-selection, overrides and broken plugins.

Third-party backends are installed for a test the way pip installs a distribution: a module and
a ``*.dist-info`` folder (METADATA + entry_points.txt) in a directory put on ``sys.path``, so
``importlib.metadata`` discovers them for real.
"""

from __future__ import annotations

import importlib
import sys
import textwrap
from importlib import metadata

import pytest

from ngram_hal import registry
from ngram_hal.backend import OPS, Backend
from ngram_hal.reference import CpuBackend

PLUGIN_MODULE = "ngram_hal_test_plugins"
PLUGIN_SOURCE = textwrap.dedent('''
    import os

    from ngram_hal.reference import CpuBackend


    class ReadyBackend(CpuBackend):
        name = "ready"


    class AbsentBackend(CpuBackend):
        name = "absent"

        @classmethod
        def is_available(cls):
            return False, "no absent device in this machine"


    class CrashingBackend(CpuBackend):
        name = "crashing"

        @classmethod
        def is_available(cls):
            raise RuntimeError("driver query crashed")


    class NotABackend:
        pass


    def _fake(name):
        class Fake(CpuBackend):
            @classmethod
            def is_available(cls):
                here = os.environ.get("FAKE_AVAILABLE", "").split(",")
                return (True, "") if name in here else (False, f"{name} switched off")
        Fake.name = name
        Fake.__name__ = f"Fake_{name}"
        return Fake


    FakeNpu, FakeRocm, FakeCuda = _fake("npu"), _fake("rocm"), _fake("cuda")
''')


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """Install a distribution 'ngram-hal-test-plugins' registering five backends, three broken."""
    (tmp_path / f"{PLUGIN_MODULE}.py").write_text(PLUGIN_SOURCE)
    info = tmp_path / "ngram_hal_test_plugins-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ngram-hal-test-plugins\nVersion: 0.0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(f"""
        [ngram_hal.backends]
        ready = {PLUGIN_MODULE}:ReadyBackend
        absent = {PLUGIN_MODULE}:AbsentBackend
        crashing = {PLUGIN_MODULE}:CrashingBackend
        notabackend = {PLUGIN_MODULE}:NotABackend
        missing = ngram_hal_no_such_module:Backend
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop(PLUGIN_MODULE, None)


def test_auto_order_constant():
    assert registry.AUTO_ORDER == ("npu", "rocm", "cuda", "cpu")


def test_names_list_auto_order_first_then_the_rest_alphabetically(plugins):
    names = registry.backend_names()
    ranked = [n for n in registry.AUTO_ORDER if n in names]
    assert names[:len(ranked)] == ranked and "cpu" in ranked
    rest = names[len(ranked):]
    assert rest == sorted(rest)
    assert {"ready", "absent", "crashing", "notabackend", "missing"} <= set(rest)


def test_list_backends_reports_broken_plugins_without_failing(plugins):
    infos = {i.name: i for i in registry.list_backends()}
    assert infos["cpu"].available and infos["cpu"].package == "ngram-hal"
    ready = infos["ready"]
    assert (ready.available, ready.package, ready.version, ready.target) == (
        True, "ngram-hal-test-plugins", "0.0.1", f"{PLUGIN_MODULE}:ReadyBackend")
    assert ready.ops == CpuBackend.implemented_ops()
    assert (infos["absent"].available, infos["absent"].reason) == (False, "no absent device in this machine")
    for name, why in (("missing", "ModuleNotFoundError: No module named 'ngram_hal_no_such_module'"),
                      ("notabackend", "TypeError: entry point 'notabackend'"),
                      ("crashing", "RuntimeError: driver query crashed")):
        info = infos[name]
        assert not info.available and info.ops == [] and info.proxy is None
        assert info.reason.startswith("failed to load: " + why), info.reason


def test_named_backend(plugins):
    backend = registry.get_backend("ready", strict=True)
    assert type(backend).__name__ == "ReadyBackend" and backend.strict
    assert str(backend.device) == "cpu"


def test_unavailable_backend_raises_with_its_reason(plugins):
    with pytest.raises(RuntimeError, match="backend 'absent' is not available: no absent device in this machine"):
        registry.get_backend("absent")


def test_unknown_backend_lists_registered_names(plugins):
    with pytest.raises(KeyError, match=r"no backend named 'nope'; registered: .*cpu.*ready"):
        registry.get_backend("nope")


def test_broken_entry_point_raises_only_when_asked_for(plugins):
    with pytest.raises(ModuleNotFoundError):
        registry.get_backend("missing")
    with pytest.raises(TypeError, match="not a ngram_hal.backend.Backend subclass"):
        registry.get_backend("notabackend")
    assert isinstance(registry.get_backend("cpu"), CpuBackend)


def test_environment_override(plugins, monkeypatch):
    monkeypatch.setenv(registry.ENV_BACKEND, "ready")
    assert type(registry.get_backend()).__name__ == "ReadyBackend"
    assert type(registry.get_backend("auto")).__name__ == "ReadyBackend"
    assert type(registry.get_backend("cpu")) is CpuBackend  # an explicit name wins over the variable
    monkeypatch.setenv(registry.ENV_BACKEND, "absent")
    with pytest.raises(RuntimeError, match="no absent device"):
        registry.get_backend()
    monkeypatch.setenv(registry.ENV_BACKEND, "")
    assert registry.get_backend().name in registry.AUTO_ORDER


def test_auto_on_this_machine_prefers_rocm_proxy_only_when_asked(monkeypatch):
    monkeypatch.delenv(registry.ENV_BACKEND, raising=False)
    monkeypatch.delenv("NGRAM_HAL_ROCM_PROXY", raising=False)
    available = [i.name for i in registry.list_backends() if i.available and i.name in registry.AUTO_ORDER]
    assert registry.get_backend().name == available[0]
    if "npu" in available or "cuda" in available or "rocm" in available:
        pytest.skip("an accelerator is available here; the proxy ordering check needs a CPU-only machine")
    assert registry.get_backend().name == "cpu"
    monkeypatch.setenv("NGRAM_HAL_ROCM_PROXY", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if not registry.backend_class("rocm").is_available()[0]:
        pytest.skip(registry.backend_class("rocm").is_available()[1])
    chosen = registry.get_backend()
    assert chosen.name == "rocm" and chosen.capabilities().proxy


@pytest.mark.parametrize("on, expected", [
    ("npu,rocm,cuda", "npu"), ("rocm,cuda", "rocm"), ("cuda,npu", "npu"), ("cuda", "cuda"), ("", "cpu"),
])
def test_auto_takes_the_first_available_in_order(plugins, monkeypatch, on, expected):
    eps = {name: metadata.EntryPoint(name, f"{PLUGIN_MODULE}:Fake{name.capitalize()}", registry.GROUP)
           for name in ("npu", "rocm", "cuda")}
    eps["cpu"] = metadata.EntryPoint("cpu", "ngram_hal.reference:CpuBackend", registry.GROUP)
    monkeypatch.setattr(registry, "_entry_points", lambda: dict(eps))
    monkeypatch.delenv(registry.ENV_BACKEND, raising=False)
    monkeypatch.setenv("FAKE_AVAILABLE", on)
    assert registry.get_backend("auto").name == expected
    eps.pop("cpu")
    if expected == "cpu":
        with pytest.raises(RuntimeError, match="no backend is available"):
            registry.get_backend("auto")


def test_auto_passes_over_backends_lacking_required_ops_and_broken_plugins(plugins, monkeypatch):
    """An available backend without the ops the caller needs, or one that fails to load, is passed
    over by auto-selection with its reason; asked for by name it raises."""
    eps = {
        "npu": metadata.EntryPoint("npu", "ngram_hal_no_such_module:Backend", registry.GROUP),
        "cuda": metadata.EntryPoint("cuda", f"{PLUGIN_MODULE}:EmptyCuda", registry.GROUP),
        "cpu": metadata.EntryPoint("cpu", "ngram_hal.reference:CpuBackend", registry.GROUP),
    }
    plugin = importlib.import_module(PLUGIN_MODULE)
    monkeypatch.setattr(plugin, "EmptyCuda", type("EmptyCuda", (Backend,), {"name": "cuda"}), raising=False)
    assert plugin.EmptyCuda.implemented_ops() == []
    monkeypatch.setattr(registry, "_entry_points", lambda: dict(eps))
    monkeypatch.delenv(registry.ENV_BACKEND, raising=False)
    assert registry.get_backend("auto").name == "cuda"
    assert registry.get_backend("auto", require=OPS).name == "cpu"
    with pytest.raises(RuntimeError, match="backend 'cuda' is lacking required ops: alloc_extend"):
        registry.get_backend("cuda", require=OPS)
    eps.pop("cpu")
    with pytest.raises(RuntimeError, match=r"npu: failed to load.*cuda: lacking required ops"):
        registry.get_backend("auto", require=OPS)


def test_passed_over_names_every_backend_before_the_one_chosen(plugins, monkeypatch):
    """Why auto-selection skipped each backend ahead of ``name``: unregistered ones included, the
    chosen one and those after it left out."""
    eps = {"npu": metadata.EntryPoint("npu", "ngram_hal_no_such_module:Backend", registry.GROUP),
           "cuda": metadata.EntryPoint("cuda", f"{PLUGIN_MODULE}:FakeCuda", registry.GROUP),
           "cpu": metadata.EntryPoint("cpu", "ngram_hal.reference:CpuBackend", registry.GROUP)}
    monkeypatch.setattr(registry, "_entry_points", lambda: dict(eps))
    monkeypatch.setenv("FAKE_AVAILABLE", "")
    reasons = registry.passed_over("cpu", OPS)
    assert [r.split(":")[0] for r in reasons] == ["npu", "rocm", "cuda"]
    assert "failed to load" in reasons[0] and "not registered" in reasons[1] and "cuda switched off" in reasons[2]
    assert [r.split(":")[0] for r in registry.passed_over("cuda", OPS)] == ["npu", "rocm"]
