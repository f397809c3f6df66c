"""What the benchmark scripts share: the report header, the console and table, writing the JSON report,
resetting an engine's drafting, device memory figures, and the timers (host-timed calls,
graph-replayed device time, copy bandwidth)."""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

import ngram_hal
from ngram_hal.files import write_atomic


def utc_now(timespec: str = "auto") -> str:
    """The current UTC time in ISO 8601."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec=timespec)


def tool_versions(device: torch.device) -> dict:
    """Triton's and the device driver's versions as the conformance suite reads them (None for
    both where the suite, a distribution of its own, is not installed)."""
    try:
        from ngram_hal_conformance.report import collect_versions
    except ImportError:
        return {"triton": None, "driver": None}
    found = collect_versions(None, str(device))
    return {"triton": found.triton, "driver": found.driver}


def report_header(schema: str, backend) -> dict:
    """The first keys of a backend benchmark's report: schema, time, backend and device, versions
    (ngram-hal, torch and its CUDA or HIP, Triton, the device driver, Python), host."""
    return {
        "schema": schema,
        "created": utc_now("seconds"),
        "backend": backend.name,
        "device": str(backend.device),
        "device_name": backend.runtime.device_name,
        "proxy": backend.proxy,
        "versions": {"ngram_hal": ngram_hal.__version__, "torch": torch.__version__, "cuda": torch.version.cuda,
                     "hip": torch.version.hip, **tool_versions(backend.device), "python": platform.python_version()},
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


def dumps(value, indent: int = 2, level: int = 0) -> str:
    """``value`` as JSON, indented, but with each list of plain values (token ids, timings) on one
    line: a run's token ids take a line a request, not a line a token."""
    pad, inner = " " * (indent * level), " " * (indent * (level + 1))
    if isinstance(value, dict) and value:
        items = (f"{inner}{json.dumps(str(k))}: {dumps(v, indent, level + 1)}" for k, v in value.items())
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(value, (list, tuple)) and any(isinstance(v, (dict, list, tuple)) for v in value):
        return "[\n" + ",\n".join(inner + dumps(v, indent, level + 1) for v in value) + f"\n{pad}]"
    return json.dumps(value)


def write_json(path: str | Path, report: dict) -> None:
    """Write ``report`` as indented JSON (:func:`dumps`) to ``path``, creating its folder; a reader
    never sees half a file (:func:`ngram_hal.files.write_atomic`; its ``WriteError`` names the path)."""
    write_atomic(path, dumps(report) + "\n")


def write_report(path: str | Path, report: dict, console: Console) -> None:
    """Write ``report`` as indented JSON to ``path`` (creating its folder) and say where."""
    write_json(path, report)
    console.print(f"wrote {path}")


def error_text(exc: BaseException) -> str:
    """``Type: message`` of an exception (the message's first 500 characters), for a report."""
    return f"{type(exc).__name__}: {str(exc)[:500]}"


# ------------------------------------------------------------------ device memory






def release_memory(device: torch.device) -> None:
    """Collect garbage and hand the device allocator's free blocks back (CUDA and ROCm)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------ timers


def median_ms(fn: Callable[[], object], sync: Callable[[], None], repeats: int, warmup: int) -> float:
    """Median wall time of one call of ``fn`` followed by ``sync()``, in ms, after ``warmup`` calls.

    On an accelerator this is the eager cost: the host's launch work plus the device's run.
    """
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def graph_ms(fn: Callable[[], object], device: torch.device, calls: int, replays: int,
             warmup: int = 3) -> float | None:
    """Device time of one call of ``fn`` replayed from a CUDA graph, in ms; None off CUDA.

    ``fn`` runs ``warmup`` times on a side stream (compiling kernels, filling allocator caches),
    then ``calls`` calls are captured in one graph, which is replayed once untimed and then
    ``replays`` times between CUDA events; the result is the elapsed time over ``replays * calls``.
    """
    if device.type != "cuda":
        return None
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    elapsed = start.elapsed_time(end) / (replays * calls)
    del graph
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # the graph's private memory pool, which no later graph reuses
    return elapsed


def name_list(text: str) -> list[str]:
    """An argparse ``type``: comma-separated names (``"plain,spec8"``), at least one."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated names")
    return names


def launch_settings(text: str) -> dict[str, int | bool | None]:
    """``--launch``'s ``FIELD=VALUE,...``: each value an int, true, false or none."""
    settings: dict[str, int | bool | None] = {}
    for item in text.split(","):
        name, sep, value = (part.strip() for part in item.partition("="))
        word = value.lower()
        if not sep or not name:
            raise argparse.ArgumentTypeError(f"{item!r}: expected FIELD=VALUE")
        if word in ("true", "false", "none"):
            settings[name] = None if word == "none" else word == "true"
            continue
        try:
            settings[name] = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r}: expected an int, true, false or none") from None
    return settings
