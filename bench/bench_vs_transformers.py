"""ngram-hal's engine against Hugging Face transformers on the same GGUF model, side by side.

Batch 1, greedy, the same token ids in for both, on the same device in the same dtype. Per prompt
group (copy-heavy, open-ended): plain decode tokens/s (ours vs ``generate``), the speculative speedup
(ours with vs without speculation; transformers with vs without ``prompt_lookup_num_tokens``),
tokens committed per target forward for both, and how closely our greedy tokens match transformers'
greedy tokens: the mean common prefix, and the prompts that match exactly (also for transformers'
prompt lookup and static cache against its own greedy output).

Ours runs plain (D = 1), with the trie drafter, with the linear prompt-lookup drafter (the same
algorithm as transformers' prompt lookup; also drafted on the device where the backend runs Triton
model kernels) and with the trie under the ``auto`` policy (each step
picks 1, 2, 4 or D nodes from measured throughput), their drafters and policies new after the
warm-up (learning across the prompts from there, as a server's would); on an accelerator through the backend ``auto`` picks there (``cuda`` on an NVIDIA GPU), with
captured step graphs. Transformers runs ``generate`` greedy, with prompt lookup, and (by default
off the CPU; ``--hf-static``) with ``cache_implementation="static"``; a setting that fails is
recorded with its error and left out. Tokens/s is end to end per request (prefill included), the
same for both sides. All settings run one after another on each prompt, so a change in machine
load hits all of them. "Tokens per forward" is new tokens / target forwards (ours: verify steps
+ 1 prefill; theirs: forward calls), so a plain decode scores 1.0 on both sides. Each prompt also
runs once more with one new token on our plain engine and transformers' greedy: the prefill's time
(with the token it gives), so that each side's speedup is also reported over its decode time alone
(the time after the prefill: ``decode_speedup``), where a long prompt's prefill, the same work with
speculation or without, weighs less. Warm-up: on the
CPU one request of four tokens per setting after the longest prompt (a prefill past the compiled
kernel's rows too); elsewhere every prompt once per setting, untimed (kernel compilation, graph
capture).

    python bench/bench_vs_transformers.py [--max-new-tokens 64] [--threads 1] [--json PATH]   # CPU, float32
    python bench/bench_vs_transformers.py --device cuda       # bfloat16, 128 new tokens, HF static cache too
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (error_text, make_console, make_table, peak_rss_bytes,  # noqa: E402
                    report_header, write_json, write_report)

from ngram_hal.backend import OPS  # noqa: E402
from ngram_hal.cli.engine_args import DTYPES  # noqa: E402
from ngram_hal.cli.setup import default_drafter  # noqa: E402
from ngram_hal.engine.engine import Engine, EngineConfig  # noqa: E402
from ngram_hal.engine.gguf_loader import find_model_file  # noqa: E402
from ngram_hal.engine.model import LlamaModel  # noqa: E402
from ngram_hal.engine.request import SamplingParams  # noqa: E402
from ngram_hal.engine.tokenizer import Tokenizer  # noqa: E402
from ngram_hal.engine.workload import load_prompts  # noqa: E402
from ngram_hal.registry import get_backend  # noqa: E402

SCHEMA = "ngram-hal-bench-vs-transformers/2"


class Ours:
    """Our engine with one setting, serving one request at a time."""

    def __init__(self, model, tok, tree_size: int, drafter: str, policy: str = "always"):
        self.engine = Engine(model, tok, EngineConfig(tree_size=tree_size, drafter=drafter, spec_policy=policy,
                                                      max_running=1, num_slots=4096, max_context_len=2048))

    def __call__(self, ids: list[int], max_new: int) -> tuple[list[int], float, int]:
        """(token ids, seconds, target forwards: verify steps + the prefill)."""
        start = time.perf_counter()
        out = self.engine.generate([ids], SamplingParams(max_new_tokens=max_new))[0]
        return out.token_ids, time.perf_counter() - start, out.verify_steps + 1


class Theirs:
    """transformers ``generate``, greedy, with ``extra`` arguments (prompt lookup, a static cache).

    ``sync`` drains the device before the clock stops.
    """

    def __init__(self, hf, eos: int, sync: Callable[[], None], **extra):
        self.hf, self.eos, self.sync, self.extra = hf, eos, sync, extra

    def __call__(self, ids: list[int], max_new: int) -> tuple[list[int], float, int]:
        """(token ids, seconds, target forward calls: counted by a hook with prompt lookup, else one per
        new token, as greedy decoding makes; no hook inside a forward that may be compiled)."""
        calls = [0]
        lookup = "prompt_lookup_num_tokens" in self.extra
        handle = self.hf.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)) if lookup else None
        inp = torch.tensor([ids], device=self.hf.device)
        try:
            with torch.inference_mode():
                start = time.perf_counter()
                out = self.hf.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=max_new,
                                       do_sample=False, eos_token_id=self.eos, pad_token_id=self.eos, **self.extra)
                self.sync()
                seconds = time.perf_counter() - start
        finally:
            if handle is not None:
                handle.remove()
        new = out[0, len(ids):].tolist()
        return new, seconds, calls[0] if lookup else len(new)


def summarize(rows):
    tokens = sum(len(t) for t, _, _ in rows)
    seconds = sum(s for _, s, _ in rows)
    forwards = sum(f for _, _, f in rows)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "tokens_per_forward": tokens / forwards}


def speed(sums: dict, a: str, b: str) -> float | None:
    """Throughput of run ``a`` over run ``b`` (None when either is missing)."""
    if a not in sums or b not in sums:
        return None
    return sums[a]["tokens_per_s"] / sums[b]["tokens_per_s"]


def decode_speedup(sums: dict, a: str, b: str, prefill_s: float) -> float | None:
    """Run ``a``'s speedup over run ``b`` on the time after the prefill: ``b``'s seconds less
    ``prefill_s`` over ``a``'s less the same (None when either is missing or a run took no longer
    than the prefill)."""
    if a not in sums or b not in sums:
        return None
    after_a, after_b = sums[a]["seconds"] - prefill_s, sums[b]["seconds"] - prefill_s
    return after_b / after_a if after_a > 0 and after_b > 0 else None


def prefix_match(a: list[int], b: list[int]) -> float:
    """Length of the common prefix over the longer length (1.0: identical)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n / max(len(a), len(b), 1)


def exact(runs: dict, a: str, b: str) -> int | None:
    """Prompts on which runs ``a`` and ``b`` gave the same tokens (None when either is missing)."""
    if a not in runs or b not in runs:
        return None
    return sum(x[0] == y[0] for x, y in zip(runs[a], runs[b]))


def _cell(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default=None, help="prompts JSONL (default: the bundled prompts)")
    ap.add_argument("--device", default="cpu", help="torch device for both sides (default cpu)")
    ap.add_argument("--backend", default=None,
                    help="our backend (default: cpu on the CPU, else the one auto picks on the device)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="auto",
                    help="weights and KV dtype of both sides (default auto: float32 on the CPU, bfloat16 elsewhere)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default 64 on the CPU, 128 elsewhere")
    ap.add_argument("--tree-size", type=int, default=8, metavar="D", help="our tree size D")
    ap.add_argument("--lookup-tokens", type=int, default=None,
                    help="transformers prompt_lookup_num_tokens (default D - 1: as many draft tokens as ours)")
    ap.add_argument("--hf-static", action=argparse.BooleanOptionalAction, default=None,
                    help="also transformers with cache_implementation='static', eager (default: off the CPU only)")
    ap.add_argument("--hf-compile", action="store_true",
                    help="also the static cache with the torch.compile transformers applies to it on a GPU "
                         "(slow to start: a compilation per prompt length)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default="reports/bench_vs_transformers.json")
    args = ap.parse_args(argv)
    on_cpu = torch.device(args.device).type == "cpu"
    if args.max_new_tokens is None:
        args.max_new_tokens = 64 if on_cpu else 128
    if args.hf_static is None:
        args.hf_static = not on_cpu
    if args.backend is None:
        args.backend = "cpu" if on_cpu else "auto"
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    if args.threads:
        torch.set_num_threads(args.threads)
    lookup = args.lookup_tokens or args.tree_size - 1
    path = find_model_file()
    backend = get_backend(args.backend, device=args.device, require=OPS)
    model = LlamaModel.from_gguf(backend, path, DTYPES[args.dtype])
    tok = Tokenizer(model.tokenizer_metadata)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=model.dtype)
    hf.to(backend.device)
    hf.eval()
    specs = load_prompts(args.prompts)
    groups = {}
    for s in specs:
        groups.setdefault(s.kind, []).append(s)
    console = make_console(200)
    dtype = str(model.dtype).removeprefix("torch.")
    sync = backend.runtime.synchronize
    systems = {
        "ours_plain": Ours(model, tok, 1, "trie"),
        "ours_trie": Ours(model, tok, args.tree_size, "trie"),
        "ours_linear": Ours(model, tok, args.tree_size, "linear"),
        "ours_auto": Ours(model, tok, args.tree_size, "trie", "auto"),
        **({"ours_device": Ours(model, tok, args.tree_size, "device")} if default_drafter(backend) == "device" else {}),
        "hf_plain": Theirs(hf, tok.eos_token_id, sync),
        "hf_pld": Theirs(hf, tok.eos_token_id, sync, prompt_lookup_num_tokens=lookup),
    }
    if args.hf_static:
        systems["hf_static"] = Theirs(hf, tok.eos_token_id, sync, cache_implementation="static", disable_compile=True)
    if args.hf_compile:
        systems["hf_static_compiled"] = Theirs(hf, tok.eos_token_id, sync, cache_implementation="static")
    report = {**report_header(SCHEMA, backend), "transformers": transformers.__version__, "model": path.name,
              "dtype": dtype, "graphs": systems["ours_plain"].engine.graphs is not None,
              "threads": torch.get_num_threads(), "max_new_tokens": args.max_new_tokens,
              "tree_size": args.tree_size, "prompt_lookup_num_tokens": lookup, "settings": list(systems),
              "failed": {}, "groups": {}}
    failed = report["failed"]

    def attempt(name: str, ids: list[int], max_new: int):
        """The system's result, or None once it has failed (its error recorded, the others go on)."""
        if name in failed:
            return None
        try:
            return systems[name](ids, max_new)
        except Exception as exc:
            failed[name] = error_text(exc)
            console.print(f"{name}: {failed[name]}", style="yellow", markup=False, highlight=False)
            return None

    if backend.runtime.is_host:
        # The longest prompt: its prefill compiles the paths of many rows too, before any clock runs.
        warm_prompts, warm_tokens = [max((tok.encode_chat(s.messages) for s in specs), key=len)], 4
    else:
        warm_prompts, warm_tokens = [tok.encode_chat(s.messages) for s in specs], args.max_new_tokens
    for name in systems:
        for ids in warm_prompts:
            attempt(name, ids, warm_tokens)
    for system in systems.values():
        if isinstance(system, Ours):
            system.engine.forget_drafts()  # what the warm-up taught the drafter must not help the timed runs

    table = make_table(f"ngram-hal vs transformers {transformers.__version__}, batch 1, greedy, "
                       f"{report['device_name']}, {dtype}",
                       ("prompts", "ours tok/s", "HF tok/s", "ours/HF", "HF static tok/s", "ours spec tok/s",
                        "ours speedup", "ours linear speedup", "ours auto speedup", "ours device speedup",
                        "HF PLD speedup", "ours auto decode speedup", "HF PLD decode speedup", "ours tok/fwd",
                        "ours linear tok/fwd", "HF PLD tok/fwd", "match vs HF", "ours = HF", "HF PLD = HF"),
                       left=("prompts",))
    for kind, group in groups.items():
        runs = {name: [] for name in systems}
        prefill = {"ours_plain": 0.0, "hf_plain": 0.0}
        for s in group:
            ids = tok.encode_chat(s.messages)
            for name in systems:
                got = attempt(name, ids, args.max_new_tokens)
                if got is not None:
                    runs[name].append(got)
            for name in prefill:
                got = attempt(name, ids, 1)
                if got is not None:
                    prefill[name] += got[1]
        runs = {name: v for name, v in runs.items() if name not in failed}
        sums = {k: summarize(v) for k, v in runs.items()}
        decode = {"ours_auto": decode_speedup(sums, "ours_auto", "ours_plain", prefill["ours_plain"]),
                  "hf_pld": decode_speedup(sums, "hf_pld", "hf_plain", prefill["hf_plain"])}
        n = len(group)
        match = None
        if "ours_plain" in runs and "hf_plain" in runs:
            match = statistics.mean(prefix_match(a[0], b[0]) for a, b in zip(runs["ours_plain"], runs["hf_plain"]))
        same_spec = {name: exact(runs, name, "ours_plain")
                     for name in ("ours_trie", "ours_linear", "ours_auto", "ours_device") if name in systems}
        entry = {"prompts": [s.id for s in group], "runs": sums,
                 "ours_vs_hf_plain": speed(sums, "ours_plain", "hf_plain"),
                 "ours_spec_speedup": speed(sums, "ours_trie", "ours_plain"),
                 "ours_linear_speedup": speed(sums, "ours_linear", "ours_plain"),
                 "ours_auto_speedup": speed(sums, "ours_auto", "ours_plain"),
                 "ours_device_speedup": speed(sums, "ours_device", "ours_plain"),
                 "hf_pld_speedup": speed(sums, "hf_pld", "hf_plain"),
                 "hf_static_speedup": speed(sums, "hf_static", "hf_plain"),
                 "prefill_s": {"ours": prefill["ours_plain"], "hf": prefill["hf_plain"]},
                 "decode_speedup": decode,
                 "greedy_prefix_match_vs_hf": match,
                 "targets": cpu_targets(sums),
                 "spec_equals_plain": all(v == n for v in same_spec.values() if v is not None),
                 "same_as_ours_plain": same_spec,
                 "same_as_hf_greedy": {name: exact(runs, name, "hf_plain") for name in runs if name != "hf_plain"},
                 "token_ids": {k: [r[0] for r in v] for k, v in runs.items()}}
        report["groups"][kind] = entry
        same_hf = entry["same_as_hf_greedy"]
        tok_s = {k: v["tokens_per_s"] for k, v in sums.items()}
        per_fwd = {k: v["tokens_per_forward"] for k, v in sums.items()}
        table.add_row(f"{kind} ({n})", _cell(tok_s.get("ours_plain"), ".2f"), _cell(tok_s.get("hf_plain"), ".2f"),
                      _cell(entry["ours_vs_hf_plain"], ".2f"), _cell(tok_s.get("hf_static"), ".2f"),
                      _cell(tok_s.get("ours_trie"), ".2f"), _cell(entry["ours_spec_speedup"], ".2f"),
                      _cell(entry["ours_linear_speedup"], ".2f"), _cell(entry["ours_auto_speedup"], ".2f"),
                      _cell(entry["ours_device_speedup"], ".2f"),
                      _cell(entry["hf_pld_speedup"], ".2f"), _cell(decode["ours_auto"], ".2f"),
                      _cell(decode["hf_pld"], ".2f"), _cell(per_fwd.get("ours_trie"), ".2f"),
                      _cell(per_fwd.get("ours_linear"), ".2f"), _cell(per_fwd.get("hf_pld"), ".2f"),
                      "-" if match is None else f"{100 * match:.0f}%",
                      _cell(same_hf.get("ours_plain"), "d") + f"/{n}", _cell(same_hf.get("hf_pld"), "d") + f"/{n}")
        write_json(args.json, report)
    report["peak_rss_bytes"] = peak_rss_bytes()
    console.print(table)
    console.print(exact_line(report), highlight=False, soft_wrap=True)
    for name, error in failed.items():
        console.print(f"left out {name}: {error}", style="yellow", markup=False, highlight=False, soft_wrap=True)
    write_report(args.json, report, console)


def cpu_targets(sums: dict) -> dict:
    """Our default (``auto``) against transformers' prompt lookup on one group, measured: its
    speedup over our plain decode at least theirs over their greedy, and its tokens/s at least
    1.5x theirs. ``met`` is None where a run is missing."""
    ours, theirs = speed(sums, "ours_auto", "ours_plain"), speed(sums, "hf_pld", "hf_plain")
    ratio = speed(sums, "ours_auto", "hf_pld")
    return {"auto_speedup": ours, "hf_pld_speedup": theirs,
            "speedup_met": None if ours is None or theirs is None else ours >= theirs,
            "auto_over_hf_pld_tok_s": ratio, "tok_s_met": None if ratio is None else ratio >= 1.5}


def exact_line(report: dict) -> str:
    """Exact matches over every prompt: ours and transformers' variants against transformers' greedy."""
    total = sum(len(g["prompts"]) for g in report["groups"].values())

    def count(name: str) -> str:
        found = [g["same_as_hf_greedy"].get(name) for g in report["groups"].values()]
        return "-" if None in found or not found else str(sum(found))

    line = (f"same tokens as transformers' greedy, of {total} prompts: ours plain {count('ours_plain')}, "
            f"ours trie {count('ours_trie')}, HF prompt lookup {count('hf_pld')}")
    extra = {"hf_static": "HF static cache", "hf_static_compiled": "HF static cache compiled"}
    return line + "".join(f", {label} {count(name)}" for name, label in extra.items() if name in report["settings"])


if __name__ == "__main__":
    main()
