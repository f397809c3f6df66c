"""What an engine command sets up once for all its runs (:class:`Setup`: backend, model,
tokenizer, the one-time work before timing) and, under ``--tp``, the checks and the ranks that
replace it in the process the user started (:func:`split_ranks`)."""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import time
from collections.abc import Callable, Sequence

import torch
from rich.console import Console

from . import parallel
from .checks import (check_spec_room, check_vocab, choose_threads, busy_note, cpu_cores, kv_cache_slots, make_backend,
                     model_config, model_file, reference_note, shape_option)
from .common import write_output
from .engine_args import CPU_TREE_SIZE, DTYPES, GPU_TREE_SIZE
from ..model_kernels import default_dtype
from ..engine.engine import EngineConfig
from ..engine.progress import Status
from ..engine.request import SamplingParams
from ..engine.shapes import parameter_bytes, streamed_bytes, streaming_limit
from ..engine.tokenizer import Tokenizer
from ..engine.workload import PromptSpec

COPY_BYTES = 2**31
"""Bytes of the copy that measures a device's bandwidth for the weight-streaming limit."""
COMPILE_NOTE = "20-40 s the first time, 1-2 s after"


def default_tree_size(backend) -> int:
    """D where ``--tree-size`` is not given: :data:`~ngram_hal.cli.engine_args.CPU_TREE_SIZE` where the backend's device is
    the host (a step's rows cost in proportion), :data:`~ngram_hal.cli.engine_args.GPU_TREE_SIZE` on an accelerator (rows
    nearly free at small batches)."""
    return CPU_TREE_SIZE if backend.runtime.is_host else GPU_TREE_SIZE


def default_drafter(backend) -> str:
    """``"trie"`` where the backend's device is the host (nothing overlaps there, and the trie
    drafts from every request's text), ``"device"`` on an accelerator (drafting on the device
    lets speculative steps overlap)."""
    return "trie" if backend.runtime.is_host else "device"


def numerics_note(invariant: bool, name_off: bool) -> str:
    """What the load line says of the numerics: the batch-invariant mode where it runs; the other
    numerics where ``name_off`` (``--no-batch-invariant`` asked for them, or the backend's default
    is the mode and a model sharded over more than two ranks left it); nothing for a backend whose
    own default they are (the cpu's float32, whose greedy tokens keep in practice)."""
    if invariant:
        return ", batch-invariant"
    return ", not batch-invariant" if name_off else ""


class Setup:
    """Backend, model and tokenizer loaded once for several runs; ``status`` shows what it is doing.

    ``args`` holds the options of :func:`~ngram_hal.cli.engine_args.add_engine_arguments` (``model``, ``backend``, ``device``, ``dtype``,
    ``batch_invariant``, ``no_graphs``, ``drafter``, ``num_slots``, ``max_context_len``, ``threads``).
    ``status`` is a :class:`~ngram_hal.engine.progress.Status` or a rich console (shown as on a
    terminal). With ``check``, the tokenizer is read from the model file's metadata first and
    ``check(tokenizer)`` runs before the weights load (it raises :class:`CommandError` to stop).
    """

    def __init__(self, args: argparse.Namespace, status: Status | Console,
                 check: Callable[[Tokenizer], None] | None = None):
        self.status = status = status if isinstance(status, Status) else Status(plain=False, console=status)
        self.path = path = model_file(args)
        self.shape = shape_option(args)
        self.backend = make_backend(args)
        self.backend_note = reference_note(args, self.backend)
        if getattr(args, "drafter", None) is None:
            args.drafter = default_drafter(self.backend)
        if getattr(args, "tree_size", 0) is None:
            args.tree_size = default_tree_size(self.backend)
        self.args = args
        name, self.config = self.shape or (path.name, model_config(path))
        runtime = self.backend.runtime
        # Measured before anything is loaded, as bench_shapes does: the device is otherwise idle.
        self.copy_bandwidth = runtime.copy_bandwidth(COPY_BYTES) if self.shape and not runtime.is_host else None
        self.weights_dtype = DTYPES[args.dtype] or default_dtype(self.backend.device)
        args.num_slots = kv_cache_slots(args, name, self.config, self.weights_dtype, self.backend.runtime.free_memory())
        self.world = getattr(args, "tp", 1)  # ranks of --tp; scripts that reuse Setup have no such option
        # Ranks of --tp on the host share its cores.
        share = self.world if runtime.is_host else 1
        threads, note = choose_threads(args.threads, max(1, torch.get_num_threads() // share),
                                       max(1, cpu_cores() // share), os.getloadavg()[0])
        torch.set_num_threads(threads)
        start = time.perf_counter()
        tokenizer = None
        if check is not None:
            with status.status(f"reading the tokenizer of {path.name} ..."):
                tokenizer = Tokenizer.from_gguf(path)
            check(tokenizer)
        what = f"shape {self.shape[0]} with random weights" if self.shape else path.name
        with status.status(f"loading {what} (about 10 s) ..."):
            if self.shape:
                tokenizer = tokenizer or Tokenizer.from_gguf(path)
                check_vocab(tokenizer, *self.shape)
            self.model = self.load_model(args.batch_invariant)
        self.tokenizer = tokenizer or Tokenizer(self.model.tokenizer_metadata)
        self.load_s = time.perf_counter() - start
        self.dtype = str(self.model.dtype).removeprefix("torch.")
        caps = self.backend.capabilities()
        status.print(f"loaded {what} in {self.load_s:.1f} s")
        numerics = numerics_note(self.model.batch_invariant,
                                 args.batch_invariant is False or self.backend.invariant_by_default())
        status.print(f"using the {caps.name} backend on {caps.device}{' (proxy)' if caps.proxy else ''}, "
                     f"{self.dtype}{numerics}, {threads} thread{'s' if threads > 1 else ''}")
        if self.backend_note:
            status.print(f"note: {self.backend_note}")
        if self.world > 1:
            status.print(f"tensor parallel: {self.world} ranks over {self.backend.collective_backend()}, rank 0 prints")
        if note:
            status.print(f"note: {note}")
        self.load_start = os.getloadavg()[0]

    def load_model(self, batch_invariant: bool | None):
        """The model file loaded (again) on the backend in the chosen dtype, or with ``--shape`` a
        model of that shape with the seeded weights of :func:`~ngram_hal.engine.model.random_weights`
        (seed 0) made on the device; ``batch_invariant`` as
        :meth:`LlamaModel.from_gguf <ngram_hal.engine.model.LlamaModel.from_gguf>` takes it."""
        from ..engine.model import LlamaModel, random_weights
        from ..engine.tensor_parallel import load_shard, shard

        backend, dtype, world = self.backend, self.weights_dtype, self.world
        rank = getattr(self.args, "tp_rank", 0)
        if self.shape:
            config, weights = self.config, random_weights(self.config, 0, backend.device, dtype)
            if world > 1:
                config, weights = shard(config, weights, rank, world)
            return LlamaModel(config, weights, backend, dtype, batch_invariant,
                              tensor_parallel=world if world > 1 else None)
        if world > 1:
            return load_shard(backend, self.path, dtype, rank, world, batch_invariant)
        return LlamaModel.from_gguf(backend, self.path, dtype, batch_invariant=batch_invariant)

    @functools.cached_property
    def shape_report(self) -> dict | None:
        """With ``--shape``: its name, config, weight bytes and bytes streamed per decode step, and
        the device's copy bandwidth (measured before the model loaded; None on the host), from which
        :meth:`streaming_limit` bounds plain decoding. None without ``--shape``."""
        if not self.shape:
            return None
        dtype = self.weights_dtype
        return {"name": self.shape[0], "config": self.config.model_dump(),
                "parameter_bytes": parameter_bytes(self.config, dtype), "streamed_bytes": streamed_bytes(self.config, dtype),
                "copy_bandwidth_bytes_per_s": self.copy_bandwidth}

    def streaming_limit(self, batch: int, tokens_per_s: float) -> dict:
        """With ``--shape`` on an accelerator, for a plain run of ``batch`` requests at a time that
        made ``tokens_per_s``: the weight-streaming limit of decoding at that batch (``batch * copy
        bandwidth / bytes streamed per step``) and the share of it reached; {} otherwise."""
        shape = self.shape_report
        if not shape or not shape["copy_bandwidth_bytes_per_s"]:
            return {}
        return streaming_limit(shape["streamed_bytes"], shape["copy_bandwidth_bytes_per_s"], batch, tokens_per_s)

    def engine(self, tree_size: int, overlap: bool, batch_size: int, policy: str = "always",
               graphs: bool | None = None, num_slots: int | None = None, model=None, drafter: str | None = None):
        """An engine over ``model`` (default the loaded one) with these settings; ``graphs``,
        ``num_slots`` and ``drafter`` default to the options (``--no-graphs``, ``--num-slots``,
        ``--drafter``)."""
        from ..engine.engine import Engine

        a = self.args
        config = EngineConfig(tree_size=tree_size, drafter=drafter or a.drafter, spec_policy=policy, overlap=overlap,
                              num_slots=num_slots or a.num_slots, max_running=batch_size,
                              max_context_len=a.max_context_len, page_size=getattr(a, "page_size", 1),
                              graphs=not a.no_graphs if graphs is None else graphs, seed=getattr(a, "seed", 0))
        return Engine(model or self.model, self.tokenizer, config)

    def warm_up(self, build: Callable[[], list], specs: Sequence[PromptSpec], params: SamplingParams,
                batch_size: int) -> list:
        """The engines ``build()`` makes (on a device their graph captures and the ``auto``
        policy's calibration), each then warmed up on these prompts (kernel compiles: see
        :meth:`Engine.warm_up <ngram_hal.engine.engine.Engine.warm_up>`): all the one-time work,
        done before anything is timed and said on screen with the seconds it took."""
        prompts = [self.tokenizer.encode_chat(s.messages) for s in specs]
        host = self.backend.runtime.is_host
        what = f"numba kernels, {COMPILE_NOTE}" if host else "graph captures, kernel compiles"
        with self.status.status(f"one-time work ({what}) ..."):
            start = time.perf_counter()
            engines = build()
            for engine in engines:
                engine.warm_up(prompts, params, batch_size)
            seconds = time.perf_counter() - start
        done = "kernels compiled" if host else "graphs captured, kernels compiled"
        self.status.print(f"one-time work done in {seconds:.1f} s, not timed: {done}")
        return engines

    def load(self) -> float:
        """The highest 1-minute load average seen so far (at the set-up and now)."""
        return max(self.load_start, os.getloadavg()[0])

    def warn_if_busy(self, console: Console) -> None:
        """A warning when other processes competed for the CPU during the timed runs."""
        note = busy_note(self.load(), cpu_cores())
        if note:
            console.print(note, style="yellow", highlight=False, soft_wrap=True)

    def describe(self) -> dict:
        caps = self.backend.capabilities()
        load = self.load()
        return {"backend": caps.name, "device": caps.device, "proxy": caps.proxy, "dtype": self.dtype,
                "batch_invariant": self.model.batch_invariant, "shape": self.shape[0] if self.shape else None,
                "num_slots": self.args.num_slots, "tensor_parallel": self.world,
                "threads": torch.get_num_threads(), "cores": cpu_cores(), "load_average": round(load, 2),
                "busy": busy_note(load, cpu_cores()) is not None, "model_load_s": round(self.load_s, 2)}


def peak_rss_bytes() -> int:
    """Peak resident memory of this process (``ru_maxrss`` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def write_json(path: str, payload: dict) -> None:
    """``payload`` as indented JSON in ``path`` (``--json``), atomically."""
    write_output("--json", path, json.dumps(payload, indent=2) + "\n")


def split_ranks(command: Callable[[argparse.Namespace], int], args: argparse.Namespace,
                specs: Sequence[PromptSpec], params: SamplingParams) -> int | None:
    """Under ``--tp N``, in the process the user started: the checks that need no weights (the
    model splits, the devices, every prompt fits), then ``command`` as N ranks
    (:mod:`ngram_hal.cli.parallel`) and rank 0's exit code. None on one rank, and inside a rank."""
    if args.tp == 1 or getattr(args, "tp_rank", None) is not None:
        return None
    path = model_file(args)
    name, config = shape_option(args) or (path.name, model_config(path))
    backend = make_backend(args)
    group, devices = parallel.check_split(args, backend, config)
    if args.tree_size is None:
        args.tree_size = default_tree_size(backend)
    # Checked as a rank's Setup will check them, on a copy: the ranks size their own caches.
    checked = argparse.Namespace(**vars(args))
    dtype = DTYPES[args.dtype] or default_dtype(backend.device)
    checked.num_slots = kv_cache_slots(checked, name, config, dtype, backend.runtime.free_memory())
    check_spec_room(Tokenizer.from_gguf(path), specs, checked, params)
    del backend
    return parallel.run_ranks(command, args, group, devices)
