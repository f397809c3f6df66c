"""Launch configuration of the portable Triton kernels, chosen by the backend that runs them."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, fields

import torch

from .products import ProductTable


@dataclass(frozen=True)
class LaunchConfig:
    """How the HAL's Triton kernels are launched on one device family.

    Attributes:
        warp_size: threads that run in lockstep (32 on NVIDIA, 64 on AMD CDNA).
        num_warps: warps per program of the small index kernels.
        max_num_warps: the most warps one program may have (1024 threads: 32 on NVIDIA, 16 on AMD).
        attn_block_m: most rows (queries x query heads of one KV head) of an attention program.
        attn_tree_block_m: most rows of a tree-verify program outside the batch-invariant mode:
            shorter tiles than ``attn_block_m``, more programs over a request's nodes (on an H200
            16 rows made a 16-node verify step's attention 0.65-0.80x as long as 64 at batch 1-64:
            ``bench/bench_attention_sweep.py``).
        attn_programs: attention programs that fill the device; fewer tiles x heads than this
            split the keys. None: twice the device's multiprocessors (1 on the CPU).
        attn_invariant_fill: in the batch-invariant mode, whose key splits are fixed and mostly
            short or empty, a tile and head take their splits in as many programs as fill the device
            this many times over (``attn_programs`` each time), up to one program per split.
        attn_min_split: fewest keys a split of the keys may hold (None: one step of the key loop
            for decode and tree verify, four otherwise).
        attn_invariant_keys: keys of every split in the batch-invariant mode, where a query's splits
            sit at fixed positions whatever the batch (None: four steps of the key loop). Fewer keys
            a split spread a small batch's keys over more programs; more keys a split merge fewer
            partial results in a large batch.
        attn_invariant_fold: in the batch-invariant mode, a call whose tiles x heads fill the device
            (``attn_programs``) this many times over takes each tile and head's splits in one
            program that walks and folds them in order, with no merge launch (the same bits); None:
            never.
        attn_invariant_block_m: rows of every attention program in the batch-invariant mode (a row's
            bits follow the height); None: the smallest, one query's heads (at least 16).
        attn_num_stages: software-pipelining stages of the attention key loop (decode: one
            more).
        attn_key_bytes: bytes of K one step of the attention key loop reads per KV head (sets the
            keys per step, ``BLOCK_N``); decode and tree-verify programs (one tile of queries per
            request) and every program of the batch-invariant mode read twice as many per step.
        attn_warps: warps of an attention program (None: 4, or 8 for the largest tiles).
        attn_even_split: outside the batch-invariant mode, share each request's own keys evenly
            by the splits the host's bound on the keys asks for (True), or cut that bound into
            equal chunks, leaving the splits past a short context empty (False).
        index_block: the most entries one program handles at once in the index kernels
            (``alloc_extend``, ``assign_req_to_token``, ``gather_cache_locs``,
            ``accepted_kv_moves``); a power of two.
        kv_segment_bytes: bytes of each K/V row that one ``move_kv`` program owns, read and
            written as one contiguous segment (128: a full cache line of every row).
        move_pair_tile: move pairs one ``move_kv`` program holds in registers at once; up to this
            many pairs move straight through registers, more go through a scratch buffer.
            A power of two.
        kv_tile_bytes: bytes of K (and as many of V) one ``store_kv`` program copies.
        tile_bytes_per_thread: bytes of a data tile each thread holds in the KV kernels; sets
            their warps.
        kernel_options: extra keyword options of every kernel launch that only one Triton target
            knows, as ``(name, value)`` pairs (AMD: ``waves_per_eu``, ``matrix_instr_nonkdim``).
            Triton refuses another target's options, so a backend sets them only where that
            target compiles the kernels; launches pass ``**dict(cfg.kernel_options)``.
        tile: most elements in the per-program tile of the request-blocked kernels (tree and
            verify): a program takes as many requests as fit, at least one.
        interpreted_tile: the same bound under Triton's interpreter, where each program costs
            a fixed Python overhead per operation whatever its size, so fewer, larger programs
            run faster.
        vocab_block: probabilities of one request read per block of a pass over the vocabulary
            (a row's sum, the bonus token's scan).
        fused_linear_rows: the most rows of a forward whose projections the model runs as fused
            Triton products (:func:`ngram_hal.kernels.gpu.matmul.fused_linear`: the norm or SwiGLU
            before the product, the residual add after it, one launch) instead of the norm
            kernels and the vendor BLAS; 0: never.
        fused_linear_max_bytes: the largest weight such a product reads; larger ones (bound by
            bandwidth, where the vendor BLAS is faster) run apart.
        products: the product each weight shape runs fastest on this device, by rows, as a sweep
            chose it (:class:`~ngram_hal.kernels.triton.products.ProductTable`); shapes it does
            not list follow the two fields above. None: no table.
        rope_in_product: a QKV projection that runs as a fused product also rotates the queries
            and keys and stores K/V (:func:`ngram_hal.kernels.gpu.matmul.fused_linear`'s ``rope``)
            instead of leaving that to the rotary kernel.
        pdl: launch the model's kernels (products, norm, rotary, SwiGLU, attention and its merge,
            the greedy argmax) with programmatic dependent launch, each overlapping the end of the one before
            (:mod:`ngram_hal.kernels.triton.pdl`; NVIDIA sm_90 and later only).
        pdl_max_weight_bytes: with ``pdl``, the largest weight a product launched that way reads;
            larger products launch one after another. (On an H200 every kernel launched early
            made SmolLM2's decode steps 5-14 % faster and Llama-8B's 5-10 % slower, whose products
            each fill the device: docs/h200.md.)
    """

    warp_size: int = 32
    num_warps: int = 4
    max_num_warps: int = 32
    index_block: int = 1024
    kv_segment_bytes: int = 128
    move_pair_tile: int = 512
    kv_tile_bytes: int = 16384
    tile_bytes_per_thread: int = 128
    attn_block_m: int = 64
    attn_tree_block_m: int = 16
    attn_programs: int | None = None
    attn_min_split: int | None = None
    attn_invariant_keys: int | None = 128
    attn_invariant_fill: int = 4
    attn_invariant_fold: int | None = 2
    attn_invariant_block_m: int | None = None
    attn_num_stages: int = 2
    attn_key_bytes: int = 8192
    attn_warps: int | None = None
    attn_even_split: bool = True
    kernel_options: tuple[tuple[str, int], ...] = ()
    tile: int = 256
    interpreted_tile: int = 1 << 18
    vocab_block: int = 4096
    fused_linear_rows: int = 64
    fused_linear_max_bytes: int = 16 << 20
    products: ProductTable | None = None
    rope_in_product: bool = True
    pdl: bool = False
    pdl_max_weight_bytes: int = 16 << 20

    def attn_block_n(self, head_dim: int, elt_bytes: int, short_tiles: bool = False) -> int:
        """Keys per step of the attention loop: ``attn_key_bytes`` of K, twice that for programs
        of short tiles (decode, tree verify, every program of the batch-invariant mode); 16 to 128
        keys."""
        key_bytes = self.attn_key_bytes * (2 if short_tiles else 1)
        return max(16, min(128, pow2_floor(key_bytes // max(1, head_dim * elt_bytes))))

    def attn_split_keys(self, block_n: int, few_queries: bool = False) -> int:
        """Fewest keys one split of the attention keys holds: ``attn_min_split``, or four steps of
        ``block_n`` keys (enough work per program to hide the split's merge), one where each
        request has few queries (decode, tree verify).

        Decode and tree-verify programs hold one tile of queries per request: too little work for
        a serial key loop to pay, so one step each keeps a step's latency at one key block and the
        merge (outside the batch-invariant mode the kernel shares each request's own keys evenly
        by the splits, so a short context in a step captured for long ones uses them all)."""
        if self.attn_min_split is not None:
            return self.attn_min_split
        return block_n if few_queries else 4 * block_n

    def attn_stages(self, decode: bool = False) -> int:
        """Pipelining stages of the attention key loop: one more for decode programs."""
        return self.attn_num_stages + (1 if decode else 0)

    def attn_num_warps(self, block_m: int, block_d: int) -> int:
        """Warps of an attention program: ``attn_warps``, or 4 (8 for the largest tiles)."""
        if self.attn_warps is not None:
            return min(self.max_num_warps, self.attn_warps)
        return min(self.max_num_warps, 8 if block_m * block_d >= 128 * 128 else 4)

    def __post_init__(self):
        powers_of_two = ("index_block", "kv_segment_bytes", "move_pair_tile", "kv_tile_bytes", "attn_block_m",
                         "attn_tree_block_m", "attn_invariant_block_m")
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in ("attn_programs", "attn_warps", "attn_min_split", "attn_invariant_keys",
                                            "attn_invariant_fold", "attn_invariant_block_m"):
                continue
            if f.name == "fused_linear_rows" and value == 0:
                continue
            if f.name == "products":
                if value is not None and not isinstance(value, ProductTable):
                    raise ValueError(f"LaunchConfig.products: expected a ProductTable or None, got {value!r}")
                continue
            if f.type == "bool":
                if not isinstance(value, bool):
                    raise ValueError(f"LaunchConfig.{f.name}: expected a bool, got {value!r}")
                continue
            if f.name == "kernel_options":
                if not all(isinstance(k, str) and isinstance(v, int) for k, v in value):
                    raise ValueError(f"LaunchConfig.kernel_options: expected (name, int) pairs, got {value!r}")
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LaunchConfig.{f.name}: expected a positive int, got {value!r}")
            if f.name in powers_of_two and value & (value - 1):
                raise ValueError(f"LaunchConfig.{f.name}: expected a power of two, got {value}")

    def options(self) -> dict[str, int]:
        """The target-only launch options, as keywords for a kernel launch."""
        return dict(self.kernel_options)

    def warps(self, threads: int) -> int:
        """Warps for a program of about ``threads`` threads: a power of two in [1, max_num_warps]."""
        want = max(1, -(-threads // self.warp_size))
        n = 1
        while n < want and n < self.max_num_warps:
            n *= 2
        return n

    def rows_per_program(self, rows: int, elements_per_row: int) -> int:
        """Rows (requests) one program takes when each brings ``elements_per_row`` tile elements:
        a power of two, at least 1, at most the next power of two of ``rows``, within
        :attr:`tile` (:attr:`interpreted_tile` under the interpreter)."""
        budget = self.interpreted_tile if interpreting() else self.tile
        fit = max(1, budget // max(1, elements_per_row))
        n = 1
        while n * 2 <= fit and n < rows:
            n *= 2
        return n


def pow2_floor(n: int) -> int:
    """The largest power of two not above ``n`` (1 below 2)."""
    return 1 << (max(1, n).bit_length() - 1)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.get_device_module(device.type).get_device_properties(device).multi_processor_count


def num_programs_to_fill(device: torch.device) -> int:
    """Programs that keep ``device`` busy: twice its multiprocessors; 1 on the CPU (interpreter)."""
    if device.type == "cpu":
        return 1
    return 2 * _multiprocessors(torch.device(device.type, device.index if device.index is not None
                                             else torch.get_device_module(device.type).current_device()))


def interpreting() -> bool:
    """True when Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``), on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "").strip() == "1"


def pow2_block(n: int) -> int:
    """The smallest power of two >= ``n``, at least 2: the size of a Triton tile axis holding ``n`` entries."""
    size = 2
    while size < n:
        size *= 2
    return size


def require_contiguous(op: str, **tensors) -> None:
    """``ValueError`` naming ``op`` and the argument unless every tensor is contiguous (the
    kernels index them as flat row-major arrays)."""
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise ValueError(f"{op}: argument '{name}' must be contiguous, got strides {t.stride()}")
