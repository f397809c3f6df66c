"""``CudaRuntime``: the generic runtime plus CUDA graph capture through torch's CUDA API."""

from __future__ import annotations

import torch

from ngram_hal.runtime import Runtime


class CudaRuntime(Runtime):
    """Streams, events and pinned buffers as :class:`ngram_hal.runtime.Runtime`; graphs by
    ``torch.cuda.CUDAGraph`` on a CUDA device (none on the CPU of a proxy run)."""

    @property
    def graph_capture(self) -> bool:
        return not self.is_host

    def new_graph(self) -> "torch.cuda.CUDAGraph":
        """An empty graph to capture into."""
        self._require_graphs()
        return torch.cuda.CUDAGraph()

    def new_graph_pool(self):
        """A memory pool that several graphs can share (their captures run one after another)."""
        self._require_graphs()
        return torch.cuda.graph_pool_handle()

    def capture(self, graph: "torch.cuda.CUDAGraph", pool=None, stream=None):
        """Context manager capturing the work enqueued inside it into ``graph``."""
        self._require_graphs()
        return torch.cuda.graph(graph, pool=pool, stream=stream)

    def _require_graphs(self) -> None:
        if self.is_host:
            raise NotImplementedError(f"graph capture needs a CUDA device, not {self.device}")
