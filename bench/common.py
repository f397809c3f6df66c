"""What the benchmark scripts share: the report header, the console and table, writing the JSON report."""

from __future__ import annotations

import datetime
import json
import platform
import resource
import sys
from collections.abc import Iterable
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

import ngram_hal


def device_name(device: torch.device) -> str:
    """The processor or accelerator model behind ``device`` (its type where torch cannot tell)."""
    if device.type == "cpu":
        return platform.processor() or platform.machine()
    module = torch.get_device_module(device.type)
    return module.get_device_name(device) if hasattr(module, "get_device_name") else device.type


def utc_now(timespec: str = "auto") -> str:
    """The current UTC time in ISO 8601."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec=timespec)


def report_header(schema: str, backend) -> dict:
    """The first keys of a backend benchmark's report: schema, time, backend and device, versions, host."""
    return {
        "schema": schema,
        "created": utc_now("seconds"),
        "backend": backend.name,
        "device": str(backend.device),
        "device_name": device_name(backend.device),
        "proxy": backend.proxy,
        "versions": {"ngram_hal": ngram_hal.__version__, "torch": torch.__version__,
                     "python": platform.python_version()},
        "host": {"machine": platform.machine(), "torch_threads": torch.get_num_threads()},
    }


def machine(**versions: str) -> dict:
    """The platform and Python version, plus ``versions`` (library name -> version)."""
    return {"platform": platform.platform(), "python": platform.python_version(), **versions}


def peak_rss_bytes() -> int:
    """The process's peak resident set size in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def make_console(width: int = 150) -> Console:
    """A console as wide as the terminal, or ``width`` columns when the output is not a terminal."""
    return Console(width=None if sys.stdout.isatty() else width)


def make_table(title: str, columns: Iterable[str], left: Iterable[str] = ()) -> Table:
    """A table with ``columns``, the ones in ``left`` left-aligned and the rest right-aligned."""
    left = set(left)
    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="left" if col in left else "right")
    return table


def write_report(path: str | Path, report: dict, console: Console) -> None:
    """Write ``report`` as indented JSON to ``path`` (creating its folder) and say where."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"wrote {path}")
