"""Which backend the suite runs against: a registry name or ``module:Class``."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib import metadata

from ngram_hal.backend import Backend
from ngram_hal.registry import backend_class, list_backends


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
