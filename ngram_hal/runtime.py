"""Device runtime used by the engine's overlap loop instead of ``torch.cuda``.

``Runtime(device)`` gives streams, events, synchronisation, pinned host buffers and graph capture
for any torch device. Accelerators go through ``torch.get_device_module(device.type)``
(``torch.cuda`` for CUDA and ROCm, ``torch.npu`` once torch_npu is imported), so nothing here names
a vendor. On the CPU, work runs eagerly: streams are inert, events complete at once and there is
no graph capture.
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import time

import torch

# Graph classes of torch's device modules: torch.cuda (CUDA and ROCm), torch.npu (torch_npu).
GRAPH_CLASSES = ("CUDAGraph", "NPUGraph")


class HostStream:
    """A CPU 'stream': work is already done when it is enqueued."""

    def synchronize(self) -> None:
        pass

    def wait_event(self, event: "HostEvent") -> None:
        pass

    def wait_stream(self, stream: "HostStream") -> None:
        pass


class HostEvent:
    """A CPU 'event': complete as soon as it is recorded."""

    def record(self, stream: HostStream | None = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def wait(self, stream: HostStream | None = None) -> None:
        pass


def _cpu_model() -> str | None:
    """The processor's model name from ``/proc/cpuinfo`` (Linux), or None."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        return None
    return None


class Runtime:
    """Streams, events and host buffers of one device.

    Args:
        device: the torch device the backend runs on.
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        # The meta device (shapes only, used to prove that code never reads data) runs like the CPU.
        self._host = self.device.type in ("cpu", "meta")
        self._module = None if self._host else torch.get_device_module(self.device.type)

    @property
    def device_name(self) -> str:
        """The processor or accelerator model behind the device (``"NVIDIA H200"``; on the CPU the
        processor's model name from ``/proc/cpuinfo``, else the platform's processor or machine type)."""
        if self._host:
            return _cpu_model() or platform.processor() or platform.machine()
        get = getattr(self._module, "get_device_name", None)
        return get(self.device) if callable(get) else self.device.type

    def free_memory(self) -> int | None:
        """Bytes of device memory free now, as the device's runtime reports them (``mem_get_info``);
        None on the host or where the runtime does not say."""
        get = None if self._host else getattr(self._module, "mem_get_info", None)
        return int(get(self.device)[0]) if callable(get) else None

    def reset_peak_memory(self) -> None:
        """Start a new peak of allocated device memory (nothing on the host or where the runtime
        keeps no peak)."""
        reset = None if self._host else getattr(self._module, "reset_peak_memory_stats", None)
        if callable(reset):
            reset(self.device)

    def peak_memory(self) -> int | None:
        """Bytes of device memory allocated at the peak since :meth:`reset_peak_memory`; None on
        the host or where the runtime does not say."""
        get = None if self._host else getattr(self._module, "max_memory_allocated", None)
        return int(get(self.device)) if callable(get) else None

    def copy_bandwidth(self, nbytes: int, repeats: int = 10) -> float:
        """Bytes per second of a device-to-device copy of ``nbytes`` (bytes read plus bytes
        written): the median of ``repeats`` copies after two untimed ones."""
        src = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)
        return 2 * nbytes / self._median_seconds(lambda: dst.copy_(src), repeats)

    def matmul_throughput(self, size: int = 8192, dtype: torch.dtype = torch.bfloat16, repeats: int = 10) -> float:
        """Floating-point operations per second of a ``size`` x ``size`` x ``size`` matrix product in
        ``dtype`` (``2 * size**3`` a product): the median of ``repeats`` products after two untimed
        ones. The compute roof of a roofline, as :meth:`copy_bandwidth` is its memory roof."""
        a = torch.randn(size, size, device=self.device).to(dtype)
        b = torch.randn(size, size, device=self.device).to(dtype)
        return 2 * size ** 3 / self._median_seconds(lambda: a @ b, repeats)

    def _median_seconds(self, work, repeats: int) -> float:
        """The median wall time of ``repeats`` calls of ``work`` (each drained on the device), after
        two untimed ones."""
        for _ in range(2):
            work()
        times = []
        for _ in range(repeats):
            self.synchronize()
            start = time.perf_counter()
            work()
            self.synchronize()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def hardware(self) -> dict[str, str | int | None]:
        """What the device is, for reports: ``name`` (:attr:`device_name`), ``architecture``
        (``"sm_90"`` for CUDA, the ``gcnArchName`` for ROCm, the machine type on the CPU),
        ``memory_bytes`` (device memory; the host's physical memory on the CPU),
        ``multiprocessors`` (streaming multiprocessors or compute units; logical CPUs on the
        CPU) and ``runtime`` (``"cuda 13.0"``, ``"hip 6.2"``; None on the CPU). A field the
        device module does not give is None."""
        if self._host:
            try:
                memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            except (ValueError, OSError, AttributeError):
                memory = None
            return {"name": self.device_name, "architecture": platform.machine() or None, "memory_bytes": memory,
                    "multiprocessors": os.cpu_count(), "runtime": None}
        get = getattr(self._module, "get_device_properties", None)
        props = get(self.device) if callable(get) else None
        hip, cuda = getattr(torch.version, "hip", None), getattr(torch.version, "cuda", None)
        # CUDA builds of torch fill gcnArchName with the device's name: read it on ROCm only.
        arch = getattr(props, "gcnArchName", None) if hip else None
        if not arch and getattr(props, "major", None) is not None:
            arch = f"sm_{props.major}{props.minor}"
        runtime = f"hip {hip}" if hip else f"cuda {cuda}" if cuda and self.device.type == "cuda" else None
        return {"name": self.device_name, "architecture": arch or None,
                "memory_bytes": getattr(props, "total_memory", None),
                "multiprocessors": getattr(props, "multi_processor_count", None), "runtime": runtime}

    @property
    def is_host(self) -> bool:
        """True when the device is the CPU (streams and events are inert)."""
        return self._host

    def synchronize(self) -> None:
        """Block the host until all work queued on the device is done."""
        if not self._host:
            self._module.synchronize(self.device)

    def new_stream(self):
        """A new stream on the device (a :class:`HostStream` on the CPU)."""
        if self._host:
            return HostStream()
        return self._module.Stream(device=self.device)

    def current_stream(self):
        """The stream ops enqueue on now."""
        if self._host:
            return HostStream()
        return self._module.current_stream(self.device)

    def stream(self, stream):
        """Context manager making ``stream`` current."""
        if self._host:
            return contextlib.nullcontext()
        return self._module.stream(stream)

    def new_event(self, enable_timing: bool = False):
        """A new event (a :class:`HostEvent` on the CPU)."""
        if self._host:
            return HostEvent()
        return self._module.Event(enable_timing=enable_timing)

    @property
    def has_pinned_memory(self) -> bool:
        """Whether host buffers can be page-locked for asynchronous copies."""
        return not self._host

    def empty_host(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer for device<->host copies, pinned where the device has pinned memory."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.has_pinned_memory)

    def to_host(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy ``t`` to a host buffer without blocking; pair with an event before reading it."""
        if self._host:
            return t if out is None else out.copy_(t)
        if out is None:
            out = self.empty_host(t.shape, t.dtype)
        out.copy_(t, non_blocking=True)
        return out

    @property
    def graph_capture(self) -> bool:
        """Whether the device module offers graph capture (a graph class and a ``graph`` context)."""
        return self._graph_class() is not None

    def new_graph(self):
        """An empty graph to capture into (``CUDAGraph`` for CUDA and ROCm, ``NPUGraph`` on Ascend).

        Raises ``NotImplementedError`` where the device has no graph capture.
        """
        return self._require_graphs()()

    def new_graph_pool(self):
        """A memory pool several graphs can share (their captures run one after another); pass it
        to :meth:`capture` as ``pool``. Raises ``NotImplementedError`` where the device has none."""
        self._require_graphs()
        if not hasattr(self._module, "graph_pool_handle"):
            raise NotImplementedError(f"shared graph pools are not available on {self.device}")
        return self._module.graph_pool_handle()

    def capture(self, graph, pool=None, stream=None):
        """Context manager capturing the work enqueued inside it into ``graph``; ``graph.replay()``
        runs it again. ``pool`` shares a memory pool between graphs; ``stream`` is the side stream
        to capture on (the device module's default when None)."""
        self._require_graphs()
        return self._module.graph(graph, pool=pool, stream=stream)

    def _graph_class(self):
        if self._host or not hasattr(self._module, "graph"):
            return None
        return next((getattr(self._module, name) for name in GRAPH_CLASSES if hasattr(self._module, name)), None)

    def _require_graphs(self):
        cls = self._graph_class()
        if cls is None:
            raise NotImplementedError(f"graph capture is not available on {self.device}")
        return cls

