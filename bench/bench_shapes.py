"""The engine at real model shapes, with seeded random weights made on the device: no weights file.

For each shape (``--shapes``: a preset of :data:`ngram_hal.engine.shapes.PRESETS` or a JSON file
of LlamaConfig fields) and batch size, B prompts of ``--prompt-len`` random token ids decode
``--new-tokens`` tokens greedily through the engine (graphs and overlap on, end of sequence
ignored): plain steps, and verify steps of ``--tree-size`` D nodes drafted on the device
(``spec_policy="always"``; random weights make the drafts' acceptance meaningless, the step's
cost is what is measured). Each engine first runs the same prompts once untimed. Decode time runs
from the moment every request has its first token (the prefill's) to the last one finishing, so
prefill is left out; the time between engine turns is kept too (median and slowest).

Reported per row: decode tok/s, ms per step, and for plain steps the weight-streaming limit
(``B * copy bandwidth / bytes of weights a step reads``; the copy bandwidth is measured in the same
run) and the fraction of it reached, and the roofline: the lower of the tokens per second that the copy
bandwidth allows for a step's bytes (weights and the KV rows it reads) and that a bf16 matrix
product's measured throughput allows for its operations, and the share of it reached; for verify
steps the cost of a step against a plain step at the same batch. ``--products table,fixed`` runs
each batch twice, the projections' products as the cuda backend's sweep table for this GPU chose
them (``bench/bench_products.py``; the backend's default) and by the fixed rule, side by side (or by
a table file: ``--products table,old.json``); ``--pdl on,off`` likewise with the layer kernels
launched early (programmatic dependent launch, the cuda backend's default on sm_90) and one after
another; ``--rope on,off`` likewise with the QKV product that also rotates and stores K/V (the
Triton backends' default) and the rotary kernel after the product. ``--transformers`` adds
transformers' ``generate`` with a static cache on the same shape (its own random weights), batch 1.
``--launch FIELD=VALUE,...`` sets fields of the Triton launch configuration for every row.
``--batch-invariant`` runs the model in the batch-invariant mode (its cost: a run with it against
one without).
``--profile-steps N`` adds to each row, on CUDA, N decode steps under the profiler: kernels,
launches and device time a step, and the costliest kernels (``bench/step_profile.py``). Targets from
the real-shapes issue are checked and printed, never an exit code.

    python bench/bench_shapes.py --device cuda --shapes llama-1b,llama-8b --transformers
    python bench/bench_shapes.py --device cpu --shapes tiny.json --batch-sizes 1 --prompt-len 16 --new-tokens 4
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (launch_settings, make_console, make_table, release_memory, report_header,  # noqa: E402
                    write_json, write_report)
from step_profile import profile_steps  # noqa: E402

from ngram_hal.backend import OPS  # noqa: E402
from ngram_hal.cli.engine_args import DTYPES  # noqa: E402
from ngram_hal.options import int_list  # noqa: E402
from ngram_hal.engine.config import EngineConfig  # noqa: E402
from ngram_hal.engine.engine import Engine  # noqa: E402
from ngram_hal.engine.model import LlamaModel, random_weights  # noqa: E402
from ngram_hal.engine.request import SamplingParams  # noqa: E402
from ngram_hal.engine.shapes import (check_fits, load_shape, parameter_bytes, roofline,  # noqa: E402
                                    streamed_bytes, streaming_limit)
from ngram_hal.kernels.gpu.layer_kernels import TritonLayerKernels  # noqa: E402
from ngram_hal.kernels.triton.products import ProductTable  # noqa: E402
from ngram_hal.model_kernels import default_dtype  # noqa: E402
from ngram_hal.registry import get_backend  # noqa: E402

def modes(*choices: str, files: bool = False):
    """An argparse type: one or more of ``choices`` (with ``files``, or paths of ``.json`` files),
    comma separated, each once."""
    def parse(text: str) -> list[str]:
        got = text.split(",")
        known = [m in choices or (files and m.endswith(".json")) for m in got]
        if not all(known) or len(set(got)) != len(got):
            also = " or a .json file" if files else ""
            raise argparse.ArgumentTypeError(f"expected {' or '.join(choices)}{also}, or several comma separated; "
                                             f"got {text!r}")
        return got
    return parse


def product_table(mode: str, launch) -> ProductTable | None:
    """The product table of a ``--products`` mode: the backend's own (``table``), none (``fixed``),
    or a table file (a sweep of another commit, run beside this one's)."""
    if mode == "fixed":
        return None
    return launch.products if mode == "table" else ProductTable.load(mode)


def decode_time(engine: Engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, int, list[float]]:
    """Seconds and verify steps from the moment every request has its first token (the prefill's)
    to the last one finishing (the decoding of ``new_tokens - 1`` tokens each), and the seconds
    between the returns of consecutive engine turns over that window (with overlap, one step's
    device time each once the loop runs ahead; a turn that did one-time work stands out)."""
    engine.add_requests(prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    started, start, steps, turns, last = set(), None, 0, [], time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            started.add(out.rid)
        now = time.perf_counter()
        if start is not None:
            turns.append(now - last)
        elif len(started) == len(prompts):
            start, steps = now, engine.stats.decode_steps
        last = now
    engine.backend.synchronize()
    return time.perf_counter() - start, engine.stats.decode_steps - steps, turns


def profile_budget(args) -> int:
    """New tokens a profiled request may take: more than ``2 * --profile-steps`` verify steps can
    commit (each up to ``--tree-size`` + 1 tokens), so that none ends inside the profile."""
    return 2 * args.profile_steps * (args.tree_size + 1) + 1


def context_len(args) -> int:
    """Cache positions one request may fill: its prompt, the larger of the timed and the profiled
    new tokens, and room for a verify tree past them."""
    return args.prompt_len + max(args.new_tokens, profile_budget(args)) + 3 * args.tree_size + 8


def engine_rows(name: str, model: LlamaModel, args, bandwidth: float | None, flops: float | None) -> list[dict]:
    """The plain and verify rows of one shape, every batch size; plain rows carry their limits
    (``bandwidth`` in bytes and ``flops`` in operations per second, measured; None on the host)."""
    rows = []
    gen = torch.Generator().manual_seed(args.seed)
    vocab = model.config.vocab_size
    context = context_len(args)
    streamed = streamed_bytes(model.config, model.dtype)
    triton = isinstance(model.kernels, TritonLayerKernels)
    if not triton and args.products not in (None, ["fixed"]):
        raise SystemExit(f"--products {','.join(args.products)}: the {model.backend.name} backend's model kernels "
                         "have no product table")
    if not triton and args.pdl not in (None, ["off"]):
        raise SystemExit(f"--pdl {','.join(args.pdl)}: the {model.backend.name} backend's model kernels "
                         "launch without programmatic dependent launch")
    if not triton and args.rope not in (None, ["off"]):
        raise SystemExit(f"--rope {','.join(args.rope)}: the {model.backend.name} backend's model kernels "
                         "have no QKV product that rotates")
    if args.launch and not triton:
        raise SystemExit(f"--launch: the {model.backend.name} backend's model kernels have no Triton launch "
                         "configuration")
    # The backend's own launch holds its GPU's product table and launch mode (and --launch's fields).
    launch = model.kernels.launch if triton else None
    if args.launch:
        settable = {f.name for f in dataclasses.fields(launch)} - {"products", "pdl", "rope_in_product"}
        unknown = sorted(set(args.launch) - settable)
        if unknown:
            raise SystemExit(f"--launch {','.join(unknown)}: no such LaunchConfig field (--products, --pdl and "
                             "--rope set those three)")
        launch = dataclasses.replace(launch, **args.launch)
    product_modes = args.products or ["table" if launch is not None and launch.products is not None else "fixed"]
    pdl_modes = args.pdl or ["on" if launch is not None and launch.pdl else "off"]
    rope_modes = args.rope or ["on" if launch is not None and launch.rope_in_product else "off"]
    for batch in args.batch_sizes:
        prompts = torch.randint(0, vocab, (batch, args.prompt_len), generator=gen).tolist()
        for products, pdl, rope in itertools.product(product_modes, pdl_modes, rope_modes):
            if triton:
                # The model's kernels and the backend's attention launch alike.
                model.kernels.launch = model.backend.launch = dataclasses.replace(
                    launch, products=product_table(products, launch), pdl=pdl == "on", rope_in_product=rope == "on")
            plain_ms = None
            for tree_size in (1, args.tree_size):
                config = EngineConfig(tree_size=tree_size, drafter="device", spec_policy="always",
                                      num_slots=batch * context, max_running=batch, max_context_len=context,
                                      max_prefill_tokens=batch * args.prompt_len)
                engine = Engine(model, config=config, eos_token_ids=[])
                # One untimed pass of the timed length: the first pass over a new engine has had
                # one-time pauses of 160-390 ms (docs/h200.md), which are no cost of a step.
                engine.generate(prompts, SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True))
                seconds, steps, turns = decode_time(engine, prompts, args.new_tokens)
                tokens = batch * (args.new_tokens - 1)
                ms = 1e3 * seconds / max(steps, 1)
                row = {"shape": name, "batch": batch, "tree_size": tree_size, "products": products, "pdl": pdl,
                       "rope": rope,
                       "decode_tokens_per_s": tokens / seconds, "ms_per_step": ms, "steps": steps,
                       "turn_ms_median": 1e3 * statistics.median(turns) if turns else None,
                       "turn_ms_max": 1e3 * max(turns) if turns else None}
                if args.profile_steps and model.device.type == "cuda":
                    row["profile"] = profile_steps(engine, prompts, SamplingParams(
                        max_new_tokens=profile_budget(args), ignore_eos=True), args.profile_steps)
                if tree_size == 1:
                    plain_ms = ms
                    if bandwidth:
                        row |= streaming_limit(streamed, bandwidth, batch, row["decode_tokens_per_s"])
                        # Keys a request holds, averaged over the timed decode.
                        keys = args.prompt_len + args.new_tokens // 2
                        row |= roofline(model.config, model.dtype, batch, keys, bandwidth, flops,
                                        row["decode_tokens_per_s"])
                else:
                    row["step_vs_plain"] = ms / plain_ms
                rows.append(row)
                del engine
                release_memory(model.device)
    if triton:
        model.kernels.launch = model.backend.launch = launch
    return rows


def transformers_row(name: str, config, device: torch.device, dtype: torch.dtype, args) -> dict:
    """transformers' greedy ``generate`` with a static cache on the same shape, batch 1: a run of
    N new tokens minus a run of 1 (its prefill). Eager: a static cache would otherwise make
    transformers compile the forward first, which takes minutes per shape."""
    import transformers

    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim, rope_theta=config.rope_theta,
        rms_norm_eps=config.rms_norm_eps, max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings)
    with torch.device(device):
        model = transformers.LlamaForCausalLM._from_config(hf_config).to(dtype).eval()
    ids = torch.randint(0, config.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(args.seed))
    ids = ids.to(device)
    sync = torch.get_device_module(device.type).synchronize if device.type != "cpu" else (lambda: None)

    def run(n: int) -> float:
        sync()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, cache_implementation="static",
                       disable_compile=True, pad_token_id=0)
        sync()
        return time.perf_counter() - start

    run(2)
    seconds = run(args.new_tokens) - run(1)
    return {"shape": name, "batch": 1, "transformers_tokens_per_s": (args.new_tokens - 1) / seconds,
            "transformers_version": transformers.__version__}


TARGETS = (("llama-8b", "plain decode, batch 1, share of the weight-streaming limit", 0.90),
           ("llama-1b", "plain decode, batch 1, share of the weight-streaming limit", 0.80))


def targets(rows: list[dict], tree_size: int) -> list[dict]:
    """The issue's targets, measured where this run has the row (the first ``--products``, ``--pdl``
    and ``--rope`` modes')."""
    modes = ("products", "pdl", "rope")
    rows = [r for r in rows if all(r[m] == rows[0][m] for m in modes)] if rows else rows
    found = []
    for shape, what, goal in TARGETS:
        row = next((r for r in rows if r["shape"] == shape and r["batch"] == 1 and r["tree_size"] == 1), None)
        got = row.get("fraction_of_limit") if row else None
        found.append({"target": f"{shape}: {what}", "goal": f">= {goal:.0%}", "measured": got,
                      "met": None if got is None else got >= goal})
    for shape in ("llama-1b", "llama-8b"):
        for batch, goal in ((1, 1.10), (16, 1.30)):
            row = next((r for r in rows if r["shape"] == shape and r["batch"] == batch and r["tree_size"] == tree_size),
                       None)
            got = row["step_vs_plain"] if row else None
            found.append({"target": f"{shape}: a D={tree_size} verify step / a plain step, batch {batch}",
                          "goal": f"<= {goal:.2f}x", "measured": got, "met": None if got is None else got <= goal})
    return found


def roof_cell(row: dict) -> str:
    """The lower roof of a plain row and what sets it (m: bytes, c: operations), or "-"."""
    if "bound_by" not in row:
        return "-"
    return f"{row[row['bound_by'] + '_roof_tokens_per_s']:,.0f} {row['bound_by'][0]}"


def print_tables(shapes: list[dict], rows: list[dict], hf: list[dict], found: list[dict], console) -> None:
    table = make_table("shapes", ("shape", "layers", "hidden", "vocab", "weights GB", "streamed GB/token", "peak GB"),
                       left=("shape",))
    for s in shapes:
        peak = s.get("peak_device_memory_bytes")
        table.add_row(s["shape"], str(s["config"]["num_layers"]), str(s["config"]["hidden_size"]),
                      str(s["config"]["vocab_size"]), f"{s['parameter_bytes'] / 1e9:.2f}",
                      f"{s['streamed_bytes'] / 1e9:.2f}", "-" if peak is None else f"{peak / 1e9:.2f}")
    console.print(table)
    table = make_table("decode (prefill excluded; turn: between engine turns, median / slowest; roof: the lower "
                       "roofline, m set by bytes, c by operations)",
                       ("shape", "B", "products", "pdl", "rope", "D", "tok/s", "ms/step", "turn ms", "limit tok/s",
                        "of limit", "roof tok/s", "of roof", "step / plain", "transformers tok/s"), left=("shape",))
    for r in rows:
        other = next((h for h in hf if h["shape"] == r["shape"] and h["batch"] == r["batch"] and r["tree_size"] == 1),
                     None)
        table.add_row(r["shape"], str(r["batch"]), r["products"], r["pdl"], r["rope"], str(r["tree_size"]),
                      f"{r['decode_tokens_per_s']:,.0f}",
                      f"{r['ms_per_step']:.3f}",
                      "-" if r["turn_ms_median"] is None else f"{r['turn_ms_median']:.2f} / {r['turn_ms_max']:.1f}",
                      f"{r['limit_tokens_per_s']:,.0f}" if "limit_tokens_per_s" in r else "-",
                      f"{r['fraction_of_limit']:.0%}" if "fraction_of_limit" in r else "-",
                      roof_cell(r), f"{r['fraction_of_roofline']:.0%}" if "fraction_of_roofline" in r else "-",
                      f"{r['step_vs_plain']:.2f}x" if "step_vs_plain" in r else "-",
                      f"{other['transformers_tokens_per_s']:,.0f}" if other else "-")
    console.print(table)
    table = make_table("targets (measured; not an exit code)", ("target", "goal", "measured", "met"), left=("target",))
    for t in found:
        got = t["measured"]
        table.add_row(t["target"], t["goal"], "not measured" if got is None else f"{got:.2f}",
                      "-" if t["met"] is None else ("yes" if t["met"] else "no"))
    console.print(table)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="llama-1b,llama-8b", help="presets or JSON files, comma separated")
    parser.add_argument("--backend", default="auto", help="registered backend (default: auto)")
    parser.add_argument("--device", default=None, help="torch device (default: the backend's)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="auto",
                        help="weights and KV cache (default auto: bfloat16 on an accelerator, float32 on the CPU)")
    parser.add_argument("--batch-sizes", type=int_list, default=[1, 16], metavar="B,...")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--tree-size", type=int, default=8, metavar="D", help="nodes of the verify step (default 8)")
    parser.add_argument("--transformers", action="store_true", help="also time transformers on each shape, batch 1")
    parser.add_argument("--copy-bytes", type=int, default=2**31, help="bytes of the bandwidth copy (default: 2 GiB)")
    parser.add_argument("--products", type=modes("table", "fixed", files=True), default=None, metavar="table,fixed",
                        help="the projections' products: the cuda backend's sweep table for this GPU, the fixed rule, "
                             "a product table file, or several side by side (default: the backend's own, the table "
                             "where it has one)")
    parser.add_argument("--pdl", type=modes("on", "off"), default=None, metavar="on,off",
                        help="the layer kernels launched early (programmatic dependent launch) or one after another, "
                             "or both side by side (default: the backend's own)")
    parser.add_argument("--rope", type=modes("on", "off"), default=None, metavar="on,off",
                        help="the QKV product rotating queries and keys and storing K/V itself, or the rotary kernel "
                             "after it, or both side by side (default: the backend's own)")
    parser.add_argument("--launch", type=launch_settings, default={}, metavar="FIELD=VALUE,...",
                        help="override fields of the Triton launch configuration (LaunchConfig: an int, true, false "
                             "or none; --products, --pdl and --rope set those three)")
    parser.add_argument("--profile-steps", type=int, default=0, metavar="N",
                        help="on CUDA, profile N decode steps of each row after its timed pass: kernels, launches and "
                             "device time per step, the costliest kernels (default 0: off)")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="the model in the batch-invariant mode: a row's bits whatever the rows beside it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="reports/bench_shapes.json", help="where to write the JSON report")
    args = parser.parse_args(argv)
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (the first token comes from the prefill)")
    if args.profile_steps < 0:
        parser.error(f"argument --profile-steps: {args.profile_steps}: expected 0 or more")
    try:
        shapes = [load_shape(spec) for spec in args.shapes.split(",")]
    except ValueError as exc:
        parser.error(str(exc))
    backend = get_backend(args.backend, device=args.device, require=OPS)
    if args.batch_invariant and not backend.batch_invariant:
        parser.error(f"--batch-invariant: backend '{backend.name}' has no batch-invariant mode")
    device = backend.device
    dtype = DTYPES[args.dtype] or default_dtype(device)
    bandwidth = None if backend.runtime.is_host else backend.runtime.copy_bandwidth(args.copy_bytes)
    flops = None if backend.runtime.is_host else backend.runtime.matmul_throughput(dtype=dtype)
    release_memory(device)
    context = context_len(args)
    described, rows, hf = [], [], []
    console = make_console()
    for name, config in shapes:
        check_fits(name, config, dtype, max(args.batch_sizes) * context, backend.runtime.free_memory())
        backend.runtime.reset_peak_memory()
        start = time.perf_counter()
        model = LlamaModel(config, random_weights(config, args.seed, device, dtype), backend, dtype,
                           args.batch_invariant)
        made_s = time.perf_counter() - start
        rows += engine_rows(name, model, args, bandwidth, flops)
        console.print(f"{name}: {len(args.batch_sizes) * 2} engine rows in {time.perf_counter() - start:.0f} s")
        described.append({"shape": name, "config": config.model_dump(), "parameter_bytes": parameter_bytes(config, dtype),
                          "streamed_bytes": streamed_bytes(config, dtype), "weights_made_s": made_s,
                          "peak_device_memory_bytes": backend.runtime.peak_memory()})
        del model
        release_memory(device)
        if args.transformers:
            hf.append(transformers_row(name, config, device, dtype, args))
            release_memory(device)
        # The report so far, so that a run stopped part way keeps the shapes it finished.
        write_json(args.json, report(backend, args, dtype, bandwidth, flops, described, rows, hf))
    print_tables(described, rows, hf, targets(rows, args.tree_size), console)
    write_report(args.json, report(backend, args, dtype, bandwidth, flops, described, rows, hf), console)


def report(backend, args, dtype: torch.dtype, bandwidth: float | None, flops: float | None, described: list[dict],
           rows: list[dict], hf: list[dict]) -> dict:
    """The JSON report of the shapes measured so far."""
    return {**report_header("ngram-hal-bench-shapes/1", backend),
            "options": {k: v for k, v in vars(args).items() if k != "json"},
            "dtype": str(dtype).removeprefix("torch."), "copy_bandwidth_bytes_per_s": bandwidth,
            "matmul_flops_per_s": flops,
            "shapes": described, "runs": rows, "transformers": hf, "targets": targets(rows, args.tree_size)}


if __name__ == "__main__":
    main()
