"""Backend discovery through the ``ngram_hal.backends`` entry-point group, auto-selection, and
what a ``--backend`` value names (a registry name or ``module:Class``).

A backend package declares ``[project.entry-points."ngram_hal.backends"]``
``name = "module:BackendClass"``; the core never imports a vendor package by name.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata

from pydantic import BaseModel

from .backend import Backend

GROUP = "ngram_hal.backends"
ENV_BACKEND = "NGRAM_HAL_BACKEND"
# ROCm before CUDA: a ROCm build of torch also answers torch.cuda.is_available().
AUTO_ORDER = ("npu", "rocm", "cuda", "cpu")


class BackendInfo(BaseModel):
    """One registered backend, as ``ngram-hal backends`` lists it."""

    name: str
    target: str
    package: str | None
    version: str | None
    available: bool
    reason: str
    proxy: bool | None = None
    ops: list[str] = []


def _entry_points() -> dict[str, metadata.EntryPoint]:
    found = {ep.name: ep for ep in metadata.entry_points(group=GROUP)}
    if "cpu" not in found:
        found["cpu"] = metadata.EntryPoint("cpu", "ngram_hal.reference:CpuBackend", GROUP)
    return found


def _load(ep: metadata.EntryPoint) -> type[Backend]:
    cls = ep.load()
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise TypeError(f"entry point '{ep.name}' ({ep.value}) is not a ngram_hal.backend.Backend subclass")
    return cls


def backend_names() -> list[str]:
    """Registered backend names, auto order first, then the rest alphabetically."""
    names = set(_entry_points())
    return [n for n in AUTO_ORDER if n in names] + sorted(names - set(AUTO_ORDER))


def list_backends() -> list[BackendInfo]:
    """Every registered backend with its package, version and availability (or why not)."""
    infos = []
    eps = _entry_points()
    for name in backend_names():
        ep = eps[name]
        dist = getattr(ep, "dist", None)
        package = dist.name if dist is not None else "ngram-hal"
        version = dist.version if dist is not None else _own_version()
        try:
            cls = _load(ep)
            available, reason = cls.is_available()
            proxy, ops = cls.proxy, cls.implemented_ops()
        except Exception as exc:  # a broken plugin is reported, never fatal to discovery
            available, reason, proxy, ops = False, f"failed to load: {type(exc).__name__}: {exc}", None, []
        infos.append(BackendInfo(name=name, target=ep.value, package=package, version=version,
                                 available=available, reason=reason, proxy=proxy, ops=ops))
    return infos


def backend_class(name: str) -> type[Backend]:
    """The class registered under ``name``; ``KeyError`` listing the known names otherwise."""
    eps = _entry_points()
    if name not in eps:
        raise KeyError(f"no backend named '{name}'; registered: {', '.join(backend_names())}")
    return _load(eps[name])


def get_backend(name: str = "auto", strict: bool | None = None, device=None,
                require: Sequence[str] = ()) -> Backend:
    """An instance of backend ``name``.

    ``"auto"`` (or ``NGRAM_HAL_BACKEND`` when set) takes the first of npu, rocm, cuda, cpu that
    loads, is available and implements every op in ``require`` (the engine asks for all of
    :data:`ngram_hal.backend.OPS`); the error lists why each candidate was passed over. A named
    backend that is unavailable or lacks a required op raises ``RuntimeError`` with the reason:
    no silent fallback.
    """
    if name == "auto":
        name = os.environ.get(ENV_BACKEND, "auto") or "auto"
    if name != "auto":
        cls = backend_class(name)
        reason = _unusable(cls, require)
        if reason:
            raise RuntimeError(f"backend '{name}' is {reason}")
        return cls(device=device, strict=strict)
    skipped = []
    for candidate, cls, reason in _auto_candidates(require):
        if cls is not None:
            return cls(device=device, strict=strict)
        skipped.append(f"{candidate}: {reason}")
    raise RuntimeError("no backend is available" + (f" ({'; '.join(skipped)})" if skipped else ""))


def passed_over(name: str, require: Sequence[str] = ()) -> list[str]:
    """Why auto-selection passed over each backend before ``name`` (``"cuda: not registered (no
    installed package declares it)"``, ...), in :data:`AUTO_ORDER`."""
    reasons = []
    for candidate, _, reason in _auto_candidates(require, unregistered=True):
        if candidate == name:
            break
        reasons.append(f"{candidate}: {reason}")
    return reasons


def _auto_candidates(require: Sequence[str], unregistered: bool = False):
    """``(name, class or None, why not)`` for each backend of :data:`AUTO_ORDER` that is registered
    (every one with ``unregistered``), the class where it loads, is available and has ``require``."""
    names = set(_entry_points())
    for candidate in AUTO_ORDER:
        if candidate not in names:
            if unregistered:
                yield candidate, None, "not registered (no installed package declares it)"
            continue
        try:
            cls = backend_class(candidate)
        except Exception as exc:  # a broken plugin is passed over, never fatal to auto-selection
            yield candidate, None, f"failed to load: {type(exc).__name__}: {exc}"
            continue
        reason = _unusable(cls, require)
        yield candidate, None if reason else cls, reason


def _unusable(cls: type[Backend], require: Sequence[str]) -> str:
    """Why ``cls`` cannot serve a caller needing ``require`` ("" when it can)."""
    available, reason = cls.is_available()
    if not available:
        return f"not available: {reason}"
    missing = [op for op in require if op not in cls.implemented_ops()]
    if missing:
        return f"lacking required ops: {', '.join(missing)}"
    return ""


def _own_version() -> str | None:
    try:
        return metadata.version("ngram-hal")
    except metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class Target:
    """A resolved ``--backend`` value.

    Attributes:
        spec: the value as given (``"cpu"`` or ``"pkg.mod:MyBackend"``).
        cls: the backend class.
        target: ``module:Class`` of the class.
        package: ``"distribution==version"`` of the package that provides it, or None when the
            class does not come from an installed distribution.
    """

    spec: str
    cls: type[Backend]
    target: str
    package: str | None


def resolve(spec: str) -> Target:
    """Resolve ``spec``; raises ``LookupError`` (unknown or unloadable) or ``RuntimeError``
    (registered but not available here, with the backend's reason)."""
    if ":" in spec:
        cls = _import_class(spec)
        package = _distribution_of(cls.__module__)
    else:
        try:
            cls = backend_class(spec)
        except KeyError as exc:
            raise LookupError(exc.args[0]) from exc
        except Exception as exc:  # a plugin that fails to import or is no Backend
            raise LookupError(f"backend '{spec}' failed to load: {type(exc).__name__}: {exc}") from exc
        info = next(i for i in list_backends() if i.name == spec)
        package = f"{info.package}=={info.version}" if info.package and info.version else info.package
    available, reason = cls.is_available()
    if not available:
        raise RuntimeError(f"backend '{spec}' is not available here: {reason}")
    return Target(spec=spec, cls=cls, target=f"{cls.__module__}:{cls.__qualname__}", package=package)


def _import_class(spec: str) -> type[Backend]:
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any failure while importing the module
        raise LookupError(f"cannot import backend module '{module_name}': {type(exc).__name__}: {exc}") from exc
    cls = module
    for part in attr.split("."):
        cls = getattr(cls, part, None)
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise LookupError(f"'{spec}' does not name a ngram_hal.backend.Backend subclass")
    return cls


def _distribution_of(module_name: str) -> str | None:
    top = module_name.partition(".")[0]
    names = metadata.packages_distributions().get(top, [])
    if not names:
        return None
    return f"{names[0]}=={metadata.version(names[0])}"
