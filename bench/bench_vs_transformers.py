"""ngram-hal's engine against Hugging Face transformers on the same GGUF model, side by side.

Batch 1, greedy, the same token ids in for both. Per prompt group (copy-heavy, open-ended):
plain decode tokens/s (ours vs ``generate``), the speculative speedup (ours with vs without
speculation; transformers with vs without ``prompt_lookup_num_tokens``), tokens committed per
target forward for both, and how closely our greedy tokens match transformers' greedy tokens.

Ours runs plain (D = 1), with the trie drafter, with the linear prompt-lookup drafter (the same
algorithm as transformers' prompt lookup) and with the trie under the ``auto`` policy (each step
picks 1, 2, 4 or D nodes from measured throughput). Tokens/s is end to end per request (prefill included),
the same for both sides. All settings run one after another on each prompt, so a change in
machine load hits all of them. "Tokens per forward" is new tokens / target forwards (ours:
verify steps + 1 prefill; theirs: forward calls), so a plain decode scores 1.0 on both sides.

    python bench/bench_vs_transformers.py [--max-new-tokens 64] [--threads 1] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import make_console, make_table, peak_rss_bytes, write_report  # noqa: E402

from ngram_hal.engine.engine import Engine, EngineConfig  # noqa: E402
from ngram_hal.engine.gguf_loader import find_model_file  # noqa: E402
from ngram_hal.engine.model import LlamaModel  # noqa: E402
from ngram_hal.engine.request import SamplingParams  # noqa: E402
from ngram_hal.engine.tokenizer import Tokenizer  # noqa: E402
from ngram_hal.engine.workload import load_prompts  # noqa: E402
from ngram_hal.registry import get_backend  # noqa: E402


class Ours:
    """Our engine with one setting, serving one request at a time."""

    def __init__(self, model, tok, spec_nodes: int, drafter: str, policy: str = "always"):
        self.engine = Engine(model, tok, EngineConfig(spec_nodes=spec_nodes, drafter=drafter, spec_policy=policy,
                                                      max_running=1, num_slots=4096, max_context_len=2048))

    def __call__(self, ids: list[int], max_new: int) -> tuple[list[int], float, int]:
        """(token ids, seconds, target forwards: verify steps + the prefill)."""
        start = time.perf_counter()
        out = self.engine.generate([ids], SamplingParams(max_new_tokens=max_new))[0]
        return out.token_ids, time.perf_counter() - start, out.verify_steps + 1


class Theirs:
    """transformers ``generate``, greedy, with or without prompt lookup decoding."""

    def __init__(self, hf, eos: int, lookup: int | None):
        self.hf, self.eos = hf, eos
        self.extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}

    def __call__(self, ids: list[int], max_new: int) -> tuple[list[int], float, int]:
        """(token ids, seconds, target forward calls)."""
        calls = [0]
        handle = self.hf.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        inp = torch.tensor([ids])
        try:
            with torch.inference_mode():
                start = time.perf_counter()
                out = self.hf.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=max_new,
                                       do_sample=False, eos_token_id=self.eos, pad_token_id=self.eos, **self.extra)
                seconds = time.perf_counter() - start
        finally:
            handle.remove()
        return out[0, len(ids):].tolist(), seconds, calls[0]


def summarize(rows):
    tokens = sum(len(t) for t, _, _ in rows)
    seconds = sum(s for _, s, _ in rows)
    forwards = sum(f for _, _, f in rows)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "tokens_per_forward": tokens / forwards}


def speed(sums: dict, a: str, b: str) -> float:
    """Throughput of run ``a`` over run ``b``."""
    return sums[a]["tokens_per_s"] / sums[b]["tokens_per_s"]


def prefix_match(a: list[int], b: list[int]) -> float:
    """Length of the common prefix over the longer length (1.0: identical)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n / max(len(a), len(b), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default=None, help="prompts JSONL (default: the bundled prompts)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--spec-nodes", type=int, default=8, help="our draft-tree nodes D")
    ap.add_argument("--lookup-tokens", type=int, default=None,
                    help="transformers prompt_lookup_num_tokens (default D - 1: as many draft tokens as ours)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default="reports/bench_vs_transformers.json")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    if args.threads:
        torch.set_num_threads(args.threads)
    lookup = args.lookup_tokens or args.spec_nodes - 1
    path = find_model_file()
    model = LlamaModel.from_gguf(get_backend("cpu"), path)
    tok = Tokenizer(model.tokenizer_metadata)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    hf.eval()
    specs = load_prompts(args.prompts)
    groups = {}
    for s in specs:
        groups.setdefault(s.kind, []).append(s)
    console = make_console(200)
    report = {"model": path.name, "threads": torch.get_num_threads(), "max_new_tokens": args.max_new_tokens,
              "spec_nodes": args.spec_nodes, "prompt_lookup_num_tokens": lookup, "groups": {}}
    table = make_table(f"ngram-hal vs transformers {__import__('transformers').__version__}, batch 1, greedy, CPU",
                       ("prompts", "ours tok/s", "HF tok/s", "ours/HF", "ours spec tok/s", "ours speedup",
                        "ours linear speedup", "ours auto speedup", "HF PLD speedup", "ours tok/fwd",
                        "ours linear tok/fwd", "HF PLD tok/fwd", "match vs HF"),
                       left=("prompts",))
    systems = {
        "ours_plain": Ours(model, tok, 1, "trie"),
        "ours_trie": Ours(model, tok, args.spec_nodes, "trie"),
        "ours_linear": Ours(model, tok, args.spec_nodes, "linear"),
        "ours_auto": Ours(model, tok, args.spec_nodes, "trie", "auto"),
        "hf_plain": Theirs(hf, tok.eos_token_id, None),
        "hf_pld": Theirs(hf, tok.eos_token_id, lookup),
    }
    warm = tok.encode_chat([{"role": "user", "content": "Hi"}])
    for system in systems.values():
        system(warm, 4)
    for kind, group in groups.items():
        runs = {name: [] for name in systems}
        for s in group:
            ids = tok.encode_chat(s.messages)
            for name, system in systems.items():
                runs[name].append(system(ids, args.max_new_tokens))
        sums = {k: summarize(v) for k, v in runs.items()}
        match = statistics.mean(prefix_match(a[0], b[0]) for a, b in zip(runs["ours_plain"], runs["hf_plain"]))
        same_spec = all(runs["ours_plain"][i][0] == runs[name][i][0] for i in range(len(group))
                        for name in ("ours_trie", "ours_linear", "ours_auto"))
        entry = {"prompts": [s.id for s in group], "runs": sums,
                 "ours_vs_hf_plain": speed(sums, "ours_plain", "hf_plain"),
                 "ours_spec_speedup": speed(sums, "ours_trie", "ours_plain"),
                 "ours_linear_speedup": speed(sums, "ours_linear", "ours_plain"),
                 "ours_auto_speedup": speed(sums, "ours_auto", "ours_plain"),
                 "hf_pld_speedup": speed(sums, "hf_pld", "hf_plain"),
                 "greedy_prefix_match_vs_hf": match, "spec_equals_plain": same_spec,
                 "token_ids": {k: [r[0] for r in v] for k, v in runs.items()}}
        report["groups"][kind] = entry
        table.add_row(f"{kind} ({len(group)})", f"{sums['ours_plain']['tokens_per_s']:.2f}",
                      f"{sums['hf_plain']['tokens_per_s']:.2f}", f"{entry['ours_vs_hf_plain']:.2f}x",
                      f"{sums['ours_trie']['tokens_per_s']:.2f}", f"{entry['ours_spec_speedup']:.2f}x",
                      f"{entry['ours_linear_speedup']:.2f}x", f"{entry['ours_auto_speedup']:.2f}x",
                      f"{entry['hf_pld_speedup']:.2f}x",
                      f"{sums['ours_trie']['tokens_per_forward']:.2f}",
                      f"{sums['ours_linear']['tokens_per_forward']:.2f}", f"{sums['hf_pld']['tokens_per_forward']:.2f}",
                      f"{100 * match:.0f}%")
    report["peak_rss_bytes"] = peak_rss_bytes()
    console.print(table)
    write_report(args.json, report, console)


if __name__ == "__main__":
    main()
