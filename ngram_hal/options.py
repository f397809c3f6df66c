"""Option values checked by pydantic, and pydantic errors as one line of text.

The command line takes the constraints of its numeric options from the pydantic models that
hold them (:func:`field_type`), so an option and the model field behind it cannot disagree, and
a bad value is reported when the arguments are parsed, before anything loads.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BaseModel, Field, TypeAdapter, ValidationError


def validation_message(exc: ValidationError) -> str:
    """A pydantic error on one line: ``where: what`` for each problem, without links or inputs."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(part) for part in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        msg = msg[:1].lower() + msg[1:]
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts)


def checked(annotation: Any) -> Callable[[str], Any]:
    """An argparse ``type`` that parses a value as ``annotation`` (pydantic, constraints included)."""
    adapter = TypeAdapter(annotation)

    def parse(text: str):
        try:
            return adapter.validate_python(text)
        except ValidationError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {validation_message(exc)}") from None

    return parse


def field_type(model: type[BaseModel], name: str) -> Callable[[str], Any]:
    """An argparse ``type`` for ``model``'s field ``name``: the option obeys the field's constraints."""
    info = model.model_fields[name]
    return checked(Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation)


POSITIVE_INT = checked(Annotated[int, Field(ge=1)])
"""An argparse ``type`` for an int of at least 1."""

FRACTION = checked(Annotated[float, Field(gt=0, le=1)])
"""An argparse ``type`` for a float in (0, 1]."""


def int_list(text: str) -> list[int]:
    """An argparse ``type``: comma-separated positive ints (``"1,16,64"``)."""
    return [POSITIVE_INT(part) for part in text.split(",")]
