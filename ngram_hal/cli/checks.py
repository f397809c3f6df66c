"""Everything an engine command checks before the model loads: the prompts, the model file, the
backend and its device, the KV cache's size, the host's threads. Each check raises
:class:`~ngram_hal.cli.common.CommandError` naming the option that was wrong."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path

import jinja2
import torch

from ..backend import OPS
from .common import CommandError, error_line
from .engine_args import DEFAULT_NUM_SLOTS
from ..registry import ENV_BACKEND, backend_class, get_backend, passed_over
from ..engine.engine import EngineConfig
from ..engine.config import LlamaConfig
from ..engine.gguf_loader import find_model_file, read_model_config
from ..engine.request import SamplingParams
from ..engine.scheduler import pages_of, request_room
from ..engine.shapes import check_fits, kv_bytes, load_shape, parameter_bytes
from ..engine.tokenizer import Tokenizer
from ..engine.workload import PromptSpec, cap_new_tokens, load_prompts


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


def tree_size_option(args: argparse.Namespace) -> str:
    """The option that set the tree size, for an error message."""
    return "--no-spec" if getattr(args, "no_spec", False) else f"--tree-size {args.tree_size}"


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

