"""Engine matrix: batch sizes x plain/speculative/auto x graphs and overlap on/off, and the batch-invariant mode.

For each batch size B, max(B, prompts) requests cycling over the prompts taken kind by kind in
turn (the bundled ones by default) go through an engine of B running requests, continuous
batching refilling the batch as requests finish, so that every batch of four or more mixes
copy-heavy and open-ended requests; at B = 1 each prompt runs alone, one after another; greedy
(``--temperature`` above 0 samples, every request with ``--seed``); these runs (``--runs`` picks
some; D0 is the first of ``--tree-sizes``):

  plain, plain-nooverlap, plain-nographs,    plain decode (D = 1), captured graphs and the overlap
  plain-nographs-nooverlap                   loop each on or off
  spec{D} for D in --tree-sizes              speculation, trie drafter, D nodes on every step
  spec{D}-device for D in --tree-sizes       speculation drafted on the device (prompt lookup)
  spec{D0}-nooverlap                         the same without overlap
  auto{D0}, auto{D}-device for D in          the auto policy (1, 2, 4, ... or D nodes a step)
    --tree-sizes
  invariant-plain, invariant-spec{D0},       the model loaded again with batch_invariant=True;
  invariant-spec{D0}-device,                 only where the backend has that mode (every run of it
  invariant-auto{D0}-device                  commits the same tokens, so ``auto`` meets the fixed
                                             sizes on the same text); every other run loads
                                             it with batch_invariant=False (mode "default" in
                                             the report), whatever the backend's default

Each run is warmed up once on its engine, untimed (Triton compiles, graphs are captured), then
timed on the same engine with a fresh drafter and speculation policy, ``--repeats`` times: the
median pass (by tokens/s) is reported, every pass's tokens/s beside it. With more than one
repeat, each pass of a run other than plain follows a pass of a plain engine kept warm for the
batch, and ``vs_plain_paired`` is the median ratio of those pairs: both sides of each ratio ran
under the same host load (the ``auto`` targets use it). Per run: tokens/s with the
prefill and decode-only tokens/s (tokens after each request's first, over the time after the last
request got its first token), tokens per verify step, steps by the tree size the policy chose (a
step runs fewer nodes when no draft fills the tree: ``mean_tree_nodes``), the device's idle time
between steps (over the decode window), peak device memory, host ms per step launching it, waiting
for the device, hidden behind the device or on its critical path, token ids. On CUDA a short extra
pass per run under ``torch.profiler`` counts GPU kernels, host launch calls and GPU busy ms per decode step
(``--profile-steps``). Ratios against plain decode of the same batch (graphs and overlap on) and
against the old baseline (graphs and overlap off); how many requests give the same tokens
with speculation as without, in each mode; the engine's GPU targets, measured (never an exit code).
A run that fails is recorded with its error and the others go on (exit code 1 at the end); the
JSON is rewritten after every run.

    python bench/bench_engine.py --device cuda                     # everything, on a GPU
    python bench/bench_engine.py --device cuda --runs plain,spec8 --batch-sizes 1
    python bench/bench_engine.py --backend cpu --quick             # tiny, on the CPU
    python bench/bench_engine.py --device cuda --shape llama-8b --runs plain,auto16-device --batch-sizes 1,16

``--shape`` runs a model of a named shape (or a JSON file of LlamaConfig fields) with seeded
random weights made on the device instead of the model file's (whose tokenizer still encodes the
prompts): the runs' costs at that size, their drafts' acceptance meaningless. Plain runs then
report the weight-streaming limit of their batch (``B * copy bandwidth / bytes of weights a step
reads``) and the share of it their decode tok/s reached.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rich.console import Console  # noqa: E402

from common import (error_text, launch_settings, make_console, make_table, name_list, peak_rss_bytes,  # noqa: E402
                    release_memory, report_header, write_json, write_report)
from step_profile import profile_steps  # noqa: E402

from ngram_hal.cli import CommandError, Parser, report_errors  # noqa: E402
from ngram_hal.cli.checks import check_tree_room, prompt_specs  # noqa: E402
from ngram_hal.cli.engine_args import DEFAULT_NUM_SLOTS, add_model_arguments, add_shape_argument  # noqa: E402
from ngram_hal.cli.setup import Setup  # noqa: E402
from ngram_hal.options import int_list  # noqa: E402
from ngram_hal.engine.request import SamplingParams  # noqa: E402
from ngram_hal.engine.workload import PromptSpec, RunResult, RunTotals, run_prompts  # noqa: E402
from ngram_hal.options import POSITIVE_INT, field_type  # noqa: E402

SCHEMA = "ngram-hal-bench-engine/2"
FULL = {"batch_sizes": [1, 16, 64], "max_new_tokens": 128, "tree_sizes": [8, 16]}
QUICK = {"batch_sizes": [1, 2], "max_new_tokens": 3, "tree_sizes": [4]}
"""Defaults of the full matrix and of ``--quick`` (one prompt of each kind, the shortest)."""
PLAIN, OLD = "plain", "plain-nographs-nooverlap"
"""The run every other is compared with, and the old baseline (no graphs, no overlap)."""


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One configuration of the matrix."""

    name: str
    tree_size: int
    policy: str = "always"
    graphs: bool = True
    overlap: bool = True
    invariant: bool = False
    drafter: str = "trie"

    @property
    def plain_name(self) -> str:
        """The plain run of the same model mode, whose tokens this run's must equal."""
        return "invariant-plain" if self.invariant else PLAIN


def run_configs(tree_sizes: Sequence[int]) -> list[RunConfig]:
    """Every configuration of the matrix, in run order, for the speculative tree sizes ``tree_sizes``."""
    d = tree_sizes[0]
    return [RunConfig(PLAIN, 1), RunConfig("plain-nooverlap", 1, overlap=False),
            RunConfig("plain-nographs", 1, graphs=False), RunConfig(OLD, 1, graphs=False, overlap=False),
            *(RunConfig(f"spec{D}", D) for D in tree_sizes),
            *(RunConfig(f"spec{D}-device", D, drafter="device") for D in tree_sizes),
            RunConfig(f"spec{d}-nooverlap", d, overlap=False), RunConfig(f"auto{d}", d, policy="auto"),
            *(RunConfig(f"auto{D}-device", D, policy="auto", drafter="device") for D in tree_sizes),
            RunConfig("invariant-plain", 1, invariant=True), RunConfig(f"invariant-spec{d}", d, invariant=True),
            RunConfig(f"invariant-spec{d}-device", d, invariant=True, drafter="device"),
            RunConfig(f"invariant-auto{d}-device", d, policy="auto", invariant=True, drafter="device")]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The options; list defaults depend on ``--quick`` (see :data:`FULL` and :data:`QUICK`)."""
    parser = Parser(prog="bench_engine.py", description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    add_shape_argument(parser)
    parser.add_argument("--prompts", metavar="FILE.jsonl", default=None, help="prompts (default: the bundled ones)")
    parser.add_argument("--batch-sizes", type=int_list, default=None, metavar="B,...",
                        help="comma-separated batch sizes (default 1,16,64; quick 1,2)")
    parser.add_argument("--max-new-tokens", type=POSITIVE_INT, default=None, metavar="N",
                        help="at most N new tokens per request (default 128; quick 3)")
    parser.add_argument("--tree-sizes", type=int_list, default=None, metavar="D,...",
                        help="speculative tree sizes; the first also runs without overlap, with auto and "
                             "batch-invariant (default 8,16; quick 4)")
    parser.add_argument("--runs", type=name_list, default=None, metavar="NAME,...",
                        help="only these runs (default: all; names in the description)")
    parser.add_argument("--requests", type=POSITIVE_INT, default=None, metavar="N",
                        help="requests per pass at batch sizes above 1: the prompts in turn, kinds interleaved "
                             "(default: each prompt once, or as many as the batch size)")
    parser.add_argument("--repeats", type=POSITIVE_INT, default=1, metavar="N",
                        help="timed passes of each run; the median one (by tokens/s) is reported (default 1)")
    parser.add_argument("--profile-steps", type=int, default=20, metavar="N",
                        help="decode steps profiled per run for kernels and launches, on CUDA (default 20; 0: off)")
    parser.add_argument("--temperature", type=field_type(SamplingParams, "temperature"), default=0.0,
                        help="0 is greedy (default); above 0 every request samples with --seed")
    parser.add_argument("--seed", type=field_type(SamplingParams, "seed"), default=0, metavar="N",
                        help="seed of every request's sampling, 0 <= N < 2**64 (default 0)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="every request runs to --max-new-tokens: the same steps at the same batch in every "
                             "run, whatever tokens a mode commits (the default stops at the model's EOS)")
    parser.add_argument("--max-context-len", type=POSITIVE_INT, default=2048,
                        help="positions per request (default 2048)")
    parser.add_argument("--threads", type=POSITIVE_INT, default=None, help="CPU threads (default: as ngram-hal run)")
    parser.add_argument("--products", choices=("table", "fixed"), default=None,
                        help="the projections' products: the cuda backend's sweep table for this GPU or the fixed "
                             "rule (default: the backend's own, the table where it has one)")
    parser.add_argument("--pdl", choices=("on", "off"), default=None,
                        help="the layer kernels launched early (programmatic dependent launch) or one after another "
                             "(default: the backend's own, early on sm_90); serial launches give profiles whose "
                             "kernel times do not overlap")
    parser.add_argument("--launch", type=launch_settings, default={}, metavar="FIELD=VALUE,...",
                        help="override fields of the Triton launch configuration (LaunchConfig: an int, true, "
                             "false or none each), e.g. attn_invariant_block_m=64, to compare settings")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny matrix for a smoke test: batches 1,2, 3 tokens, D 4, two short prompts")
    parser.add_argument("--json", metavar="PATH", default="reports/bench_engine.json",
                        help="JSON report (default reports/bench_engine.json)")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.profile_steps < 0:
        parser.error(f"argument --profile-steps: {args.profile_steps}: expected 0 or more")
    args.tree_sizes = list(dict.fromkeys(args.tree_sizes))
    if min(args.tree_sizes) < 2:
        parser.error(f"argument --tree-sizes: {min(args.tree_sizes)}: a speculative tree has at least 2 nodes")
    # What Setup reads besides the options above: one model, not batch-invariant; the trie drafter
    # (where a run names no other).
    args.batch_invariant, args.no_graphs, args.drafter, args.num_slots = False, False, "trie", DEFAULT_NUM_SLOTS
    return args


def selected_configs(args: argparse.Namespace) -> list[RunConfig]:
    """The configurations ``--runs`` asks for, in run order; a CommandError names an unknown one."""
    configs = run_configs(args.tree_sizes)
    if args.runs is None:
        return configs
    known = [c.name for c in configs]
    unknown = [name for name in args.runs if name not in known]
    if unknown:
        raise CommandError(f"--runs {unknown[0]}: no such run with --tree-sizes "
                           f"{','.join(map(str, args.tree_sizes))} (choose from {', '.join(known)})")
    return [c for c in configs if c.name in args.runs]


def mixed_order(specs: Sequence[PromptSpec]) -> list[PromptSpec]:
    """The prompts taken one of each kind in turn (kinds in first-seen order), so that any run of
    consecutive prompts as long as the number of kinds holds every kind."""
    by_kind: dict[str, list[PromptSpec]] = {}
    for spec in specs:
        by_kind.setdefault(spec.kind, []).append(spec)
    queues = list(by_kind.values())
    return [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)]


def quick_prompts(specs: Sequence[PromptSpec]) -> list[PromptSpec]:
    """The shortest prompt (in characters) of each kind, in first-seen order of the kinds."""
    def size(spec: PromptSpec) -> int:
        return sum(len(m.get("content", "")) for m in spec.messages)

    return [min((s for s in specs if s.kind == kind), key=size) for kind in dict.fromkeys(s.kind for s in specs)]


# ---------------------------------------------------------------------------- one run


OPEN_ENDED = "open"
"""The prompt kind with nothing to copy; every other kind is copy-heavy."""
COPY_HEAVY = "copy-heavy"
"""The group of every kind but :data:`OPEN_ENDED` in ``by_kind``."""


def kind_totals(results: Sequence[RunResult], batch: int) -> dict[str, dict]:
    """Per prompt kind, and for all copy-heavy kinds together (:data:`COPY_HEAVY`): requests,
    tokens, verify steps, tokens per verify step; at B = 1, where each request ran alone, also
    tokens/s and decode-only tokens/s (None in a mixed batch)."""
    out = {}
    records = [(r, rec) for r in results for rec in r.requests]
    groups = {kind: {kind} for kind in dict.fromkeys(rec.kind for _, rec in records)}
    groups[COPY_HEAVY] = {kind for kind in groups if kind != OPEN_ENDED}
    for kind, members in groups.items():
        mine = [rec for _, rec in records if rec.kind in members]
        if not mine:
            continue
        decode = sum(max(len(rec.token_ids) - 1, 0) for rec in mine)
        steps = sum(rec.verify_steps for rec in mine)
        entry = {"requests": len(mine), "output_tokens": sum(len(rec.token_ids) for rec in mine),
                 "decode_tokens": decode, "verify_steps": steps,
                 "tokens_per_verify_step": decode / steps if steps else 0.0,
                 "tokens_per_s": None, "decode_tokens_per_s": None}
        if batch == 1:
            alone = RunTotals.combine([r.totals for r, rec in records if rec.kind in members])
            entry.update(tokens_per_s=alone.tokens_per_s, decode_tokens_per_s=alone.decode_tokens_per_s)
        out[kind] = entry
    return out


def summarize(results: Sequence[RunResult], chosen: Counter) -> dict:
    """The JSON of a timed run made of ``results`` (one per prompt at B = 1, else one)."""
    totals = RunTotals.combine([r.totals for r in results])
    records = [rec for r in results for rec in r.requests]
    steps = max(totals.decode_steps + totals.prefill_steps, 1)
    return {"totals": totals.model_dump(),
            "steps_by_tree_size": {str(n): c for n, c in sorted(chosen.items())},
            "mean_tree_nodes": totals.tree_nodes / totals.decode_steps if totals.decode_steps else 0.0,
            "host_ms_per_step": {"launch": 1e3 * totals.launch_s / steps, "wait": 1e3 * totals.wait_s / steps,
                                 "hidden": 1e3 * totals.hidden_host_s / steps,
                                 "critical": 1e3 * totals.critical_host_s / steps,
                                 "draft": 1e3 * totals.draft_s / steps},
            "requests": [rec.id for rec in records], "kinds": [rec.kind for rec in records],
            "finish_reasons": [rec.finish_reason for rec in records],
            "verify_steps": [rec.verify_steps for rec in records],
            "request_errors": [rec.error for rec in records if rec.error],
            "token_ids": [rec.token_ids for rec in records]}


def profile_budget(steps: int, tree_size: int) -> SamplingParams:
    """Sampling for the profiled pass: greedy, EOS ignored, room for the lead-in and the window."""
    return SamplingParams(max_new_tokens=(2 * steps + 4) * tree_size, ignore_eos=True)


class Workload:
    """One batch size's timed work: the requests (alone one after another at B = 1, else one batch)
    and their sampling, with the profiled pass's budget where profiling runs."""

    def __init__(self, setup: Setup, batch: int, specs: list[PromptSpec], prompt_lens: dict[str, int],
                 args: argparse.Namespace):
        self.setup, self.batch, self.specs, self.args = setup, batch, specs, args
        self.groups = [[s] for s in specs] if batch == 1 else [specs]
        self.params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                     seed=args.seed if args.temperature > 0 else None,
                                     ignore_eos=args.ignore_eos)
        self.profiling = args.profile_steps > 0 and setup.backend.device.type == "cuda"
        self.longest = max(prompt_lens[s.id] for s in specs)

    def engine(self, model, cfg: "RunConfig"):
        """An engine for ``cfg`` with slots for every request of the batch (and the profiled pass)."""
        budget = profile_budget(self.args.profile_steps, cfg.tree_size)
        new = max(self.args.max_new_tokens, budget.max_new_tokens if self.profiling else 0)
        num_slots = self.batch * min(self.args.max_context_len, self.longest + new + 3 * cfg.tree_size)
        return self.setup.engine(cfg.tree_size, cfg.overlap, self.batch, cfg.policy, graphs=cfg.graphs,
                                 num_slots=num_slots, model=model, drafter=cfg.drafter)

    def run(self, engine) -> list[RunResult]:
        """Every group once on ``engine``, untimed by the caller's choice (the warm-up), then the
        captured prefill of every shape an admission may take, as :meth:`Engine.warm_up
        <ngram_hal.engine.engine.Engine.warm_up>` captures them: a timed pass whose admissions
        fall otherwise (``auto`` sizes its steps by measured times) would capture the rest."""
        results = [run_prompts(engine, self.setup.tokenizer, g, self.params) for g in self.groups]
        if engine.graphs is not None:
            engine.graphs.capture_prefills()
        return results

    def timed_pass(self, engine) -> tuple[float, list[RunResult], Counter]:
        """Every group once, each with a fresh drafter and policy: (tokens/s, results, tree sizes chosen)."""
        timed, chosen = [], Counter()
        for g in self.groups:
            engine.forget_drafts()
            timed.append(run_prompts(engine, self.setup.tokenizer, g, self.params))
            chosen.update(engine.policy.chosen)
        return RunTotals.combine([r.totals for r in timed]).tokens_per_s, timed, chosen


class PlainPartner:
    """A warmed-up plain engine (graphs and overlap on) whose passes alternate with another run's,
    so that each pass of that run has a plain pass timed just before it, under the same host load."""

    def __init__(self, work: Workload, model):
        self.work = work
        self.engine = work.engine(model, RunConfig(PLAIN, 1))
        work.run(self.engine)

    def rate(self) -> float:
        """Tokens/s of one timed plain pass."""
        return self.work.timed_pass(self.engine)[0]


def measure(work: Workload, model, cfg: RunConfig, partner: PlainPartner | None = None) -> dict:
    """Warm up and time one configuration at one batch size, then profile it on CUDA; the JSON row.

    With a ``partner``, each timed pass follows a plain pass on it: ``vs_plain_paired`` is the
    median of the passes' ratios to those. Any exception is recorded in the row (``status:
    "error"``) instead of raised.
    """
    batch, args, setup = work.batch, work.args, work.setup
    row = not_run(cfg, batch, "ok", None)
    device = setup.backend.device
    tokenizer = setup.tokenizer
    budget = profile_budget(args.profile_steps, cfg.tree_size)
    engine = None
    try:
        engine = work.engine(model, cfg)
        start = time.perf_counter()
        warm = work.run(engine)
        row["warmup_s"] = time.perf_counter() - start
        captures = engine.graphs.captures if engine.graphs is not None else None
        setup.backend.runtime.reset_peak_memory()
        passes, plain_rates = [], []
        for _ in range(args.repeats):
            if partner is not None:
                plain_rates.append(partner.rate())
            passes.append(work.timed_pass(engine))
        row["peak_device_memory_bytes"] = setup.backend.runtime.peak_memory()
        row["passes_tokens_per_s"] = [rate for rate, _, _ in passes]
        row["paired_plain_tokens_per_s"] = plain_rates or None
        row["vs_plain_paired"] = (statistics.median(p[0] / q for p, q in zip(passes, plain_rates))
                                  if plain_rates else None)
        _, timed, chosen = sorted(passes, key=lambda p: p[0])[len(passes) // 2]
        row.update(summarize(timed, chosen))
        row["by_kind"] = kind_totals(timed, batch)
        row["same_as_warmup"] = [r.token_ids for w in warm for r in w.requests] == row["token_ids"]
        row["graphs_used"] = engine.graphs is not None
        # Graphs captured in the warm-up, and in the timed run (0 expected: the same shapes recur).
        row["graph_captures"] = captures
        row["graph_captures_timed"] = engine.graphs.captures - captures if engine.graphs is not None else None
        row["kv_cache_bytes"] = engine.kv.nbytes
        # The policy's step costs after the timed passes: {bucket: {tree size: seconds}}.
        row["step_costs"] = engine.policy.costs.table() if cfg.policy == "auto" else None
        row["profile"] = None
        if work.profiling:
            engine.forget_drafts()
            profiled = work.specs[:1] if batch == 1 else work.specs  # at B = 1, the first prompt alone
            prompts = [tokenizer.encode_chat(s.messages) for s in profiled]
            try:
                row["profile"] = {"requests": [s.id for s in profiled],
                                  **profile_steps(engine, prompts, budget, args.profile_steps)}
            except Exception as exc:  # the timed figures stand without the profile
                row["profile"] = {"error": error_text(exc)}
    except Exception as exc:  # one failing configuration must not end the matrix
        row.update(status="error", error=error_text(exc), traceback=traceback.format_exc()[-3000:])
    finally:
        del engine
        release_memory(device)
    return row


def not_run(cfg: RunConfig, batch: int, status: str, reason: str) -> dict:
    """The row of a configuration that did not run: ``status`` "skipped" or "error", and why."""
    return {"batch": batch, "run": cfg.name, **{k: v for k, v in dataclasses.asdict(cfg).items() if k != "name"},
            "status": status, "error": reason}


# ---------------------------------------------------------------------------- derived figures


def _find(rows: Sequence[dict], batch: int, name: str) -> dict | None:
    """The successful run ``name`` at ``batch``, or None."""
    return next((r for r in rows if r["batch"] == batch and r["run"] == name and r["status"] == "ok"), None)


def _ratio(row: dict, base: dict | None) -> float | None:
    if base is None or not base["totals"]["tokens_per_s"]:
        return None
    return row["totals"]["tokens_per_s"] / base["totals"]["tokens_per_s"]


def same_tokens(row: dict, plain: dict | None) -> dict | None:
    """Requests of ``row`` whose tokens equal those of ``plain`` (the same requests): counts and the
    ids of those that differ; None without a plain run."""
    if plain is None:
        return None
    differ = [rid for rid, a, b in zip(row["requests"], row["token_ids"], plain["token_ids"]) if a != b]
    return {"same": len(row["requests"]) - len(differ), "of": len(row["requests"]), "differ": differ}


def add_comparisons(rows: list[dict], configs: Sequence[RunConfig]) -> None:
    """Each successful row gets ``vs_plain``, ``vs_old`` (tokens/s ratios at the same batch) and
    ``same_tokens_as_plain`` (against the plain run of its model mode)."""
    plain_of = {c.name: c.plain_name for c in configs}
    for row in rows:
        if row["status"] != "ok":
            continue
        b = row["batch"]
        row["vs_plain"] = _ratio(row, _find(rows, b, PLAIN))
        row["vs_old"] = _ratio(row, _find(rows, b, OLD))
        row["same_tokens_as_plain"] = same_tokens(row, _find(rows, b, plain_of[row["run"]]))


def exactness(rows: Sequence[dict]) -> list[dict]:
    """Speculative runs against plain decoding of the same model mode: requests with the same tokens."""
    out = []
    for row in rows:
        same = row.get("same_tokens_as_plain")
        if row["status"] == "ok" and row["tree_size"] > 1 and same is not None:
            out.append({"batch": row["batch"], "run": row["run"],
                        "mode": "invariant" if row["invariant"] else "default", **same})
    return out


def _target(name: str, goal: str, measured, met: Callable[[float], bool], run: str | None) -> dict:
    return {"target": name, "goal": goal, "measured": measured, "run": run,
            "met": None if measured is None else bool(met(measured))}


def targets(rows: Sequence[dict], configs: Sequence[RunConfig], batch_sizes: Sequence[int]) -> list[dict]:
    """The engine's GPU targets, measured: plain and speculative tokens/s at batch 1, the device's idle
    time, batch 64, auto against plain at every batch, exactness. ``met`` is None where the
    run is missing or failed (or, for idle time, where the device has no timing events)."""
    names = {c.name for c in configs}
    spec = [c.name for c in configs if c.tree_size > 1 and not c.invariant and c.graphs and c.overlap]
    d0 = next((c for c in configs if c.name.startswith("spec") and c.overlap and c.drafter == "trie"), None)
    d0_device = next((c for c in configs if c.name.startswith("spec") and c.overlap and c.drafter == "device"), None)
    out = []
    plain1 = _find(rows, 1, PLAIN)
    out.append(_target("plain decode, batch 1 (tok/s)", ">= 1000",
                       plain1["totals"]["tokens_per_s"] if plain1 else None, lambda v: v >= 1000, "B=1 plain"))
    best = None
    for name in spec:
        row = _find(rows, 1, name)
        copy = row["by_kind"].get(COPY_HEAVY) if row else None
        if copy and copy["tokens_per_s"] is not None and (best is None or copy["tokens_per_s"] > best[0]):
            best = (copy["tokens_per_s"], f"B=1 {name}")
    out.append(_target("speculation, copy-heavy prompts, batch 1 (tok/s)", ">= 2500",
                       best[0] if best else None, lambda v: v >= 2500, best[1] if best else None))
    for name in sorted(n for n in names if n.startswith("auto") and n.endswith("-device")):
        row = _find(rows, 1, name)
        copy = row["by_kind"].get(COPY_HEAVY) if row else None
        out.append(_target(f"{name}, copy-heavy prompts, batch 1 (tok/s)", ">= 4000",
                           copy["tokens_per_s"] if copy else None, lambda v: v >= 4000, f"B=1 {name}"))
    for name in [PLAIN] + [c.name for c in (d0, d0_device) if c]:
        row = _find(rows, 1, name)
        measured = None
        if row and row["totals"]["device_busy_s"] > 0:
            measured = row["totals"]["device_idle_fraction"]
        out.append(_target(f"device idle between steps, {name}, batch 1 (graphs, overlap)", "< 10%",
                           measured, lambda v: v < 0.10, f"B=1 {name}"))
    plain64 = _find(rows, 64, PLAIN)
    out.append(_target("plain decode, batch 64 (tok/s)", ">= 20000",
                       plain64["totals"]["tokens_per_s"] if plain64 else None, lambda v: v >= 20000, "B=64 plain"))
    by_name = {c.name: c for c in configs}
    for name in sorted(n for n in names if by_name[n].policy == "auto"):
        cfg = by_name[name]
        fixed = [c.name for c in configs if c.policy == "always" and c.tree_size > 1 and c.drafter == cfg.drafter
                 and c.invariant == cfg.invariant and c.graphs and c.overlap]
        for b in batch_sizes:
            row = _find(rows, b, name)
            paired = row is not None and row.get("vs_plain_paired") is not None
            ratio = (row["vs_plain_paired"] if paired else row.get("vs_plain")) if row else None
            out.append(_target(f"{name} / plain, batch {b}", ">= 0.97x", ratio, lambda v: v >= 0.97,
                               f"B={b} {name}" + (" (passes paired with plain passes)" if paired else "")))
            found = [r for r in (_find(rows, b, f) for f in fixed) if r is not None]
            top = max(found, key=lambda r: r["totals"]["tokens_per_s"], default=None)
            versus = (row["totals"]["tokens_per_s"] / top["totals"]["tokens_per_s"]
                      if row is not None and top is not None and top["totals"]["tokens_per_s"] else None)
            out.append(_target(f"{name} / best fixed size ({top['run'] if top else '-'}), batch {b}", ">= 0.97x",
                               versus, lambda v: v >= 0.97, f"B={b} {name}"))
    checks = exactness(rows)
    for mode in ("default", "invariant"):
        mine = [c for c in checks if c["mode"] == mode]
        same, total = sum(c["same"] for c in mine), sum(c["of"] for c in mine)
        out.append({"target": f"tokens with speculation == without, {mode} mode (requests)",
                    "goal": "all", "measured": f"{same}/{total}" if mine else None,
                    "run": "every speculative run" if mine else None, "met": same == total if mine else None})
    return out


def derive(report: dict, configs: Sequence[RunConfig], batch_sizes: Sequence[int]) -> None:
    """Fill in the comparisons, the exactness counts and the targets from ``report["runs"]``."""
    rows = report["runs"]
    add_comparisons(rows, configs)
    report["exactness"] = exactness(rows)
    report["targets"] = targets(rows, configs, batch_sizes)


# ---------------------------------------------------------------------------- tables


def _f(value, fmt: str, missing: str = "-") -> str:
    return missing if value is None else format(value, fmt)


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def print_tables(console: Console, report: dict) -> None:
    rows = [r for r in report["runs"] if r["status"] == "ok"]
    setup = report["setup"]
    title = f"{setup['backend']} on {report['device_name']}, {setup['dtype']}"
    speed = make_table(f"engine: speed ({title}; ratios against plain of the same batch, and old: no graphs, "
                       "no overlap)",
                       ("B", "run", "tok/s", "decode tok/s", "tok/verify", "nodes/step", "idle", "vs plain",
                        "paired", "vs old", "same", "peak MiB"), left=("run",))
    for r in rows:
        t, same, peak = r["totals"], r.get("same_tokens_as_plain"), r["peak_device_memory_bytes"]
        busy = t["device_busy_s"] > 0
        speed.add_row(str(r["batch"]), r["run"], f"{t['tokens_per_s']:.1f}", f"{t['decode_tokens_per_s']:.1f}",
                      f"{t['tokens_per_verify_step']:.2f}", f"{r['mean_tree_nodes']:.2f}",
                      _pct(t["device_idle_fraction"] if busy else None), _f(r.get("vs_plain"), ".2f"),
                      _f(r.get("vs_plain_paired"), ".2f"), _f(r.get("vs_old"), ".2f"), f"{same['same']}/{same['of']}" if same else "-",
                      _f(peak / 2**20 if peak is not None else None, ".0f"))
    console.print(speed)
    limited = [r for r in rows if "limit_tokens_per_s" in r]
    if limited:
        shape = report["shape"]
        table = make_table(f"engine: plain decoding against the weight-streaming limit (shape {shape['name']}: "
                           f"{shape['streamed_bytes'] / 1e9:.2f} GB a step, copy bandwidth "
                           f"{shape['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s)",
                           ("B", "run", "decode tok/s", "limit tok/s", "of limit"), left=("run",))
        for r in limited:
            table.add_row(str(r["batch"]), r["run"], f"{r['totals']['decode_tokens_per_s']:,.1f}",
                          f"{r['limit_tokens_per_s']:,.0f}", f"{r['fraction_of_limit']:.0%}")
        console.print(table)
    steps = make_table("engine: per step (host ms launching the step / waiting for the device / hidden behind it / "
                       "on its critical path / in the drafter: where launch + hidden fill the step, the host sets "
                       "the pace; profiled decode steps: GPU kernels, host launch calls, GPU busy ms)",
                       ("B", "run", "ms/step", "launch", "wait", "hidden", "critical", "draft", "kernels", "launches",
                        "GPU ms", "tree sizes"),
                       left=("run", "tree sizes"))
    for r in rows:
        t, prof = r["totals"], r["profile"] or {}
        sizes = " ".join(f"{n}:{c}" for n, c in r["steps_by_tree_size"].items() if c)
        host = r["host_ms_per_step"]
        steps.add_row(str(r["batch"]), r["run"], f"{t['ms_per_decode_step']:.2f}",
                      *(f"{host[k]:.2f}" for k in ("launch", "wait", "hidden", "critical", "draft")),
                      _f(prof.get("gpu_kernels_per_step"), ".0f", "error" if "error" in prof else "-"),
                      _f(prof.get("host_launch_calls_per_step"), ".0f"), _f(prof.get("gpu_busy_ms_per_step"), ".3f"),
                      sizes)
    console.print(steps)
    kinds = list(dict.fromkeys(k for r in rows for k in r["by_kind"]))
    by_kind = make_table("engine: by prompt kind (tok/s only at B = 1, where each prompt runs alone)",
                         ("B", "run", *(f"{k} tok/s" for k in kinds), *(f"{k} tok/verify" for k in kinds)),
                         left=("run",))
    for r in rows:
        cells = [r["by_kind"].get(k, {}) for k in kinds]
        by_kind.add_row(str(r["batch"]), r["run"], *(_f(c.get("tokens_per_s"), ".1f") for c in cells),
                        *(_f(c.get("tokens_per_verify_step"), ".2f") for c in cells))
    console.print(by_kind)
    exact = make_table("speculation against plain decoding (same model mode and sampling): requests with the same tokens",
                       ("B", "run", "mode", "same", "differ"), left=("run", "mode", "differ"))
    for e in report["exactness"]:
        exact.add_row(str(e["batch"]), e["run"], e["mode"], f"{e['same']}/{e['of']}", ", ".join(e["differ"]))
    console.print(exact)
    goals = make_table("targets (measured; not an exit code)", ("target", "goal", "measured", "met", "run"),
                       left=("target", "run"))
    for t in report["targets"]:
        m = t["measured"]
        shown = m if isinstance(m, str) or m is None else (_pct(m) if "idle" in t["target"] else
                                                           f"{m:.2f}x" if t["goal"].endswith("x") else f"{m:.1f}")
        goals.add_row(t["target"], t["goal"], shown or "not measured",
                      {True: "yes", False: "no", None: "-"}[t["met"]], t["run"] or "")
    console.print(goals)
    for r in report["runs"]:
        if r["status"] != "ok":
            console.print(f"B={r['batch']} {r['run']}: {r['status']}: {r['error']}", style="yellow",
                          highlight=False, markup=False, soft_wrap=True)


# ---------------------------------------------------------------------------- main


def bench(args: argparse.Namespace) -> int:
    """Run the matrix of the module docstring; 0, or 1 when a run failed (its error is in the JSON)."""
    specs = prompt_specs(args)
    if args.quick:
        specs = quick_prompts(specs)
    check_tree_room(max(args.tree_sizes), args.max_context_len)
    configs = selected_configs(args)
    console, status = make_console(), Console(stderr=True, soft_wrap=True)
    setup = Setup(args, status)
    backend, tokenizer = setup.backend, setup.tokenizer
    launch_modes(setup.model, args)
    prompt_lens = {s.id: len(tokenizer.encode_chat(s.messages)) for s in specs}
    report = {**report_header(SCHEMA, backend), "setup": setup.describe(), "model": setup.path.name,
              "shape": setup.shape_report,
              "options": {"batch_sizes": args.batch_sizes, "max_new_tokens": args.max_new_tokens,
                          "tree_sizes": args.tree_sizes, "profile_steps": args.profile_steps,
                          "max_context_len": args.max_context_len, "repeats": args.repeats,
                          "requests": args.requests, "quick": args.quick, "products": args.products,
                          "pdl": args.pdl, "launch": args.launch,
                          "temperature": args.temperature, "seed": args.seed if args.temperature > 0 else None,
                          "ignore_eos": args.ignore_eos},
              "prompts": [{"id": s.id, "kind": s.kind, "prompt_tokens": prompt_lens[s.id],
                           "max_new_tokens": s.max_new_tokens} for s in specs],
              "configurations": [dataclasses.asdict(c) for c in configs], "runs": []}
    invariant = None  # (model, status, reason), once the first invariant run asks for it
    for batch in args.batch_sizes:
        mixed = mixed_order(specs)
        count = max(batch, args.requests or len(mixed))
        requests = [mixed[i % len(mixed)] for i in range(count)] if batch > 1 else list(specs)
        work = Workload(setup, batch, requests, prompt_lens, args)
        partner = None
        if args.repeats > 1:
            with status.status(f"B={batch}: the plain engine that alternates with each run ..."):
                partner = PlainPartner(work, setup.model)
        for cfg in configs:
            start = time.perf_counter()
            model, state, reason = setup.model, "ok", None
            if cfg.invariant:
                invariant = invariant or load_invariant(setup, status)
                launch_modes(invariant[0], args)
                model, state, reason = invariant
            if model is None:
                row = not_run(cfg, batch, state, reason)
            else:
                with status.status(f"B={batch} {cfg.name} ..."):
                    row = measure(work, model, cfg, partner if cfg.name != PLAIN else None)
                if cfg.tree_size == 1 and row["status"] == "ok":
                    row |= setup.streaming_limit(batch, row["totals"]["decode_tokens_per_s"])
            report["runs"].append(row)
            status.print(run_line(row, time.perf_counter() - start), highlight=False, markup=False)
            derive(report, configs, args.batch_sizes)
            write_json(args.json, report)
        del partner
        release_memory(setup.backend.device)
    report["peak_rss_bytes"] = peak_rss_bytes()
    report["load_average"] = round(setup.load(), 2)
    print_tables(console, report)
    write_report(args.json, report, console)
    setup.warn_if_busy(console)
    failed = sum(r["status"] == "error" for r in report["runs"])
    if failed:
        console.print(f"{failed} of {len(report['runs'])} runs failed (errors in {args.json})", style="red",
                      highlight=False)
    return 1 if failed else 0


def launch_modes(model, args: argparse.Namespace) -> None:
    """``model``'s Triton launches as ``--launch`` (fields of the launch configuration), ``--products``
    (the backend's sweep table or the fixed rule) and ``--pdl`` (its layer kernels and attention
    launched early or one after another) ask; None leaves the backend's choice. A CommandError where
    the backend cannot do what is asked."""
    if model is None:
        return
    backend, launch = model.backend, getattr(model.kernels, "launch", None)
    backend_launch = getattr(backend, "launch", None)
    if args.launch:
        if launch is None or backend_launch is None:
            raise CommandError(f"--launch: the {backend.name} backend has no Triton launch configuration")
        for name in args.launch:
            if name in ("products", "pdl") or name not in {f.name for f in dataclasses.fields(backend_launch)}:
                raise CommandError(f"--launch {name}: no such LaunchConfig field (--products and --pdl set those two)")
        try:
            launch = model.kernels.launch = dataclasses.replace(launch, **args.launch)
            backend_launch = backend.launch = dataclasses.replace(backend_launch, **args.launch)
        except ValueError as exc:
            raise CommandError(f"--launch: {exc}") from None
    if args.products is not None:
        table = getattr(backend_launch, "products", None) if args.products == "table" else None
        if args.products == "table" and (table is None or launch is None):
            raise CommandError(f"--products table: the {backend.name} backend has no product table for this device")
        if launch is not None:
            launch = model.kernels.launch = dataclasses.replace(launch, products=table)
    if args.pdl is not None:
        if args.pdl == "on" and not getattr(backend_launch, "pdl", False):
            raise CommandError(f"--pdl on: the {backend.name} backend does not launch kernels early on this device")
        if launch is not None:
            model.kernels.launch = dataclasses.replace(launch, pdl=args.pdl == "on")
            backend.launch = dataclasses.replace(backend_launch, pdl=args.pdl == "on")


def load_invariant(setup: Setup, status: Console) -> tuple:
    """``(model, "ok", None)``: the model loaded again with ``batch_invariant=True``; or ``(None,
    "skipped", why)`` where the backend has no batch-invariant mode, ``(None, "error", why)`` where
    the load fails (the default-mode runs go on without it)."""
    backend = setup.backend
    if not backend.batch_invariant:
        return None, "skipped", f"backend '{backend.name}' has no batch-invariant mode"
    try:
        with status.status("loading the model again, batch-invariant ..."):
            return setup.load_model(batch_invariant=True), "ok", None
    except Exception as exc:
        return None, "error", f"loading the batch-invariant model: {error_text(exc)}"


def run_line(row: dict, seconds: float) -> str:
    """One line on the progress of the matrix."""
    head = f"B={row['batch']} {row['run']}"
    if row["status"] != "ok":
        return f"{head}: {row['status']}: {row['error']}"
    t = row["totals"]
    return (f"{head}: {t['tokens_per_s']:.1f} tok/s, {t['decode_tokens_per_s']:.1f} decode tok/s, "
            f"{t['tokens_per_verify_step']:.2f} tok/verify step ({seconds:.1f} s)")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return report_errors(bench, args)


if __name__ == "__main__":
    sys.exit(main())
