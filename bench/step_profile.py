"""Kernels, launch calls and device time per engine step, read from a ``torch.profiler`` trace.

:func:`profile_steps` runs a few decode steps of an engine under the profiler (CPU and CUDA
activities) and :func:`count_events` turns the trace into per-step figures:

* GPU kernels: kernel events on the device, kernels replayed from a captured graph included
  (the profiler records each as its own device event); memory copies and fills are counted apart;
* host launch calls: the runtime and driver API calls that launch work (``cudaLaunchKernel``,
  ``cuLaunchKernel``/``cuLaunchKernelEx`` from Triton, ``cudaGraphLaunch``, their HIP names ...),
  and the copy/fill calls apart;
* GPU busy ms: the summed durations of the kernel events.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Iterable

from torch.autograd import DeviceType

LAUNCH_CALL = re.compile(r"(cuda|cu|hip)\w*Launch\w*")
"""Host API calls that launch device work: kernels, cooperative kernels, graphs."""
COPY_CALL = re.compile(r"(cuda|cu|hip)(Memcpy|Memset)\w*")
"""Host API calls that enqueue a copy or a fill."""
DEVICE_COPY = ("Memcpy", "Memset")
"""Name prefixes of the device events that are copies or fills, not kernels."""
TOP_KERNELS = 16
"""Kernels listed by device time in :func:`count_events`."""


def count_events(events: Iterable, steps: int) -> dict:
    """Per-step counts of a profiler trace covering ``steps`` steps (``steps >= 1``).

    ``events`` are ``torch.autograd.profiler_util.FunctionEvent`` (``prof.events()``). Device
    events are those not on the CPU; user annotations projected onto the device timeline are not
    work and are skipped. Returns ``gpu_kernels_per_step``, ``gpu_copies_per_step``,
    ``host_launch_calls_per_step``, ``host_copy_calls_per_step``, ``gpu_busy_ms_per_step`` (kernel
    time), ``gpu_copy_ms_per_step``, ``runtime_calls`` (launch and copy calls by name, whole trace)
    and ``top_kernels``: the :data:`TOP_KERNELS` kernels with the most device time, each with its
    name (cut to 96 characters), launches per step and device microseconds per step.
    """
    if steps < 1:
        raise ValueError(f"steps: expected at least 1, got {steps}")
    kernels = copies = 0
    kernel_us = copy_us = 0.0
    calls: Counter[str] = Counter()
    by_name: Counter[str] = Counter()
    time_by_name: Counter[str] = Counter()
    for event in events:
        if event.device_type != DeviceType.CPU:
            if getattr(event, "is_user_annotation", False):
                continue
            if event.name.startswith(DEVICE_COPY):
                copies += 1
                copy_us += event.time_range.elapsed_us()
            else:
                kernels += 1
                kernel_us += event.time_range.elapsed_us()
                by_name[event.name] += 1
                time_by_name[event.name] += event.time_range.elapsed_us()
        elif LAUNCH_CALL.fullmatch(event.name) or COPY_CALL.fullmatch(event.name):
            calls[event.name] += 1
    launches = sum(n for name, n in calls.items() if LAUNCH_CALL.fullmatch(name))
    return {"gpu_kernels_per_step": kernels / steps, "gpu_copies_per_step": copies / steps,
            "host_launch_calls_per_step": launches / steps,
            "host_copy_calls_per_step": (sum(calls.values()) - launches) / steps,
            "gpu_busy_ms_per_step": kernel_us / 1e3 / steps, "gpu_copy_ms_per_step": copy_us / 1e3 / steps,
            "runtime_calls": dict(sorted(calls.items())),
            "top_kernels": [{"name": name[:96], "per_step": by_name[name] / steps, "us_per_step": us / steps}
                            for name, us in time_by_name.most_common(TOP_KERNELS)]}


def profile_steps(engine, prompts: list[list[int]], params, steps: int) -> dict:
    """Profile ``steps`` calls of ``engine.step()`` in the middle of decoding ``prompts`` (the CUDA
    activity too on a CUDA device).

    The requests (token ids, one ``params`` for all; give it ``ignore_eos`` and a budget of more
    than ``2 * steps`` verify steps so that none ends early) are prefilled, then ``steps`` steps
    run unprofiled (shapes not seen before get their graphs captured there), then ``steps`` more
    under the profiler, the device drained at the end. The requests are aborted afterwards and the
    engine drained. Returns :func:`count_events` of the window plus ``decode_steps`` and
    ``prefill_steps`` run in it, ``wall_ms_per_step`` (profiler overhead included) and
    ``graph_captures`` made in it (0 expected; None without graphs).
    """
    from torch.profiler import ProfilerActivity, profile

    rids = engine.add_requests(prompts, params)
    waiting = set(rids)
    while waiting and engine.has_unfinished():
        waiting -= {out.rid for out in engine.step()}
    for _ in range(steps):
        engine.step()
    engine.backend.synchronize()
    stats, graphs = engine.stats, engine.graphs
    decode, prefill = stats.decode_steps, stats.prefill_steps
    captures = graphs.captures if graphs is not None else None
    start = time.perf_counter()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.backend.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        engine.backend.synchronize()
    wall = time.perf_counter() - start
    decode, prefill = stats.decode_steps - decode, stats.prefill_steps - prefill
    for rid in rids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    if decode == 0:
        raise RuntimeError(f"no decode step ran in the {steps} profiled engine steps")
    return {**count_events(prof.events(), decode), "decode_steps": decode, "prefill_steps": prefill,
            "wall_ms_per_step": 1e3 * wall / decode,
            "graph_captures": None if captures is None else graphs.captures - captures}

