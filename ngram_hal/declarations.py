"""The HAL's ops, each declared once: its arguments and their kinds, tied sizes, outputs and the
value rules strict mode checks.

Everything that lists ops derives from :data:`DECLARATIONS`: :data:`ngram_hal.backend.OPS`, the
conformance suite's argument tables (``cases.TENSOR_ARGS``, ``cases.TIED_ARGS``) and its timed
ops, and the op reference ``docs/ops.md`` (:func:`ops_markdown`). ``tests/test_declarations.py``
checks each declaration against :class:`~ngram_hal.backend.Backend`'s public method of the same
name (the argument names, in order) and every bundled backend's implementation (``_<op>``).

Argument kinds: ``index`` (an int64 tensor), ``mask`` (a bool tensor), ``float`` (a float
tensor), ``kv`` (a :class:`~ngram_hal.kv_cache.KVCache`), ``int`` (a host int), ``scalar`` (a host
float), ``flag`` (a host bool), ``layout`` (an :class:`~ngram_hal.layout.AttentionLayout`).
"""

from __future__ import annotations

from dataclasses import dataclass

TENSOR_KINDS = ("index", "mask", "float")


@dataclass(frozen=True)
class Arg:
    """One argument: its name, kind and whether its size is tied to an earlier tensor's (a
    mismatch raises ``ContractError`` naming it)."""

    name: str
    kind: str
    tied: bool = False


def _args(spec: str) -> tuple[Arg, ...]:
    """``"name:kind, name:kind=, ..."`` (``=`` marks a tied size) as :class:`Arg` s."""
    out = []
    for item in spec.split(","):
        name, kind = item.strip().split(":")
        out.append(Arg(name, kind.rstrip("="), kind.endswith("=")))
    return tuple(out)


@dataclass(frozen=True)
class OpDecl:
    """One op of the HAL.

    Attributes:
        name: the op, and the :class:`~ngram_hal.backend.Backend` method that runs it (its
            implementation is ``_<name>``).
        args: the method's arguments, in order.
        outputs: what it returns, in order (empty: it writes in place).
        writes: the arguments it writes in place; every other argument is read only.
        summary: what it does, in one line.
        rules: the value rules strict mode checks (reading data, a host sync), in words.
        builder: for an op whose work split is built first (attention), the builder method's
            name and arguments.
    """

    name: str
    args: tuple[Arg, ...]
    outputs: tuple[str, ...]
    summary: str
    rules: tuple[str, ...]
    builder: tuple[str, tuple[Arg, ...]] | None = None
    writes: tuple[str, ...] = ()

    def methods(self) -> dict[str, tuple[Arg, ...]]:
        """The public methods of the op (the builder first, where there is one) and their arguments."""
        first = {self.builder[0]: self.builder[1]} if self.builder else {}
        return {**first, self.name: self.args}


_ROW_RULES = ("req_pool_indices in [0, R)", "0 <= start <= end <= M")
_TREE_RULES = ("retrieve_index in [0, B*D)", "retrieve links point to later nodes of the same tree, or -1")
_VERIFY_OUT = ("accept_len in [1, D]", "accept_index: the root, then the accepted nodes of the request's own tree, -1 padded")

DECLARATIONS: tuple[OpDecl, ...] = (
    OpDecl("alloc_extend",
           _args("prefix_lens:index, seq_lens:index=, last_loc:index=, free_pages:index, page_size:int, "
                 "num_new_tokens:int"),
           ("slots",), "slots for extending B requests: the rest of each last page, then whole free pages",
           ("0 <= prefix_lens <= seq_lens", "num_new_tokens == sum(seq_lens - prefix_lens)",
            "enough free pages for every request", "last_loc >= 0 where the prefix is not empty",
            "free_pages distinct and >= 0", "out: slots >= 0")),
    OpDecl("assign_req_to_token",
           _args("req_to_token:index, req_pool_indices:index, start:index=, end:index=, locs:index"),
           (), "in place: req_to_token[r_b, start_b:end_b] = the request's run of locs",
           (*_ROW_RULES, "len(locs) == sum(end - start)", "requests share a row only with disjoint ranges"),
           writes=("req_to_token",)),
    OpDecl("gather_cache_locs",
           _args("req_to_token:index, req_pool_indices:index, start:index=, end:index=, num_tokens:int"),
           ("locs",), "the cells req_to_token[r_b, start_b:end_b], request after request",
           (*_ROW_RULES, "num_tokens == sum(end - start)")),
    OpDecl("store_kv", _args("kv:kv, layer:int, locs:index, k:float=, v:float="),
           (), "in place: one layer's K/V rows at locs (-1 skipped)",
           ("layer in [0, L)", "locs in [0, S) or -1", "locs distinct"), writes=("kv",)),
    OpDecl("move_kv", _args("kv:kv, src:index, dst:index="),
           (), "in place, every layer: row[dst[i]] = row[src[i]], every read before any write",
           ("src and dst in [0, S) or -1", "dst distinct where both sides are live"), writes=("kv",)),
    OpDecl("accepted_kv_moves",
           _args("out_cache_loc:index=, accept_index:index, req_to_token:index, req_pool_indices:index=, "
                 "seq_lens:index="),
           ("src", "dst"), "the moves that compact each request's accepted nodes into its next positions",
           ("accept_index rows hold the request's own nodes, or -1", "req_pool_indices in [0, R)",
            "0 <= seq_lens and seq_lens + D <= M", "out: -1 from a request's first -1 in accept_index on")),
    OpDecl("reconstruct_tree", _args("tree_mask:mask, seq_lens:index="),
           ("positions", "retrieve_index", "retrieve_next_token", "retrieve_next_sibling"),
           "positions and retrieve links of B draft trees",
           ("tree_mask: each node sees itself and its ancestors, parents before children", "seq_lens >= 0",
            "out: positions >= 0", "out: retrieve_index in [0, B*D)", "out: links point to later nodes, or -1")),
    OpDecl("verify_tree_greedy",
           _args("candidates:index, retrieve_index:index=, retrieve_next_token:index=, "
                 "retrieve_next_sibling:index=, target_predict:index="),
           ("predicts", "accept_index", "accept_len"), "greedy tree verification against the target's argmax",
           (*_TREE_RULES, *(f"out: {rule}" for rule in _VERIFY_OUT))),
    OpDecl("verify_tree_sample",
           _args("candidates:index, retrieve_index:index=, retrieve_next_token:index=, "
                 "retrieve_next_sibling:index=, target_probs:float=, uniform_samples:float=, uniform_final:float="),
           ("predicts", "accept_index", "accept_len"),
           "tree rejection sampling: committed tokens follow target_probs exactly",
           (*_TREE_RULES, "candidates in [0, V)", "target_probs rows >= 0, summing to 1",
            "uniform_samples and uniform_final in [0, 1)", "out: predicts in [0, V)",
            *(f"out: {rule}" for rule in _VERIFY_OUT))),
    OpDecl("attention",
           _args("q:float=, kv:kv, layer:int, req_to_token:index, req_pool_indices:index, kv_lens:index=, "
                 "q_lens:index=, sm_scale:scalar, tree_mask:mask=, max_kv_len:int, layout:layout"),
           ("out",), "paged attention of B requests' queries over the cache: prefill, decode or tree",
           ("rows of q == sum(q_lens)", "0 <= q_lens <= kv_lens", "req_pool_indices in [0, R)", "kv_lens <= M",
            "max_kv_len >= max(kv_lens)", "with a tree mask, every q_lens == D and a valid tree",
            "every slot read in [0, S)"),
           builder=("attention_layout",
                    _args("req_to_token:index, req_pool_indices:index, kv_lens:index=, q_lens:index=, "
                          "num_queries:int, tree_mask:mask=, max_kv_len:int, batch_invariant:flag"))),
)


def ops_markdown() -> str:
    """The op reference (``docs/ops.md``), made from :data:`DECLARATIONS`."""
    lines = ["# The HAL's ops", "",
             "Made from `ngram_hal/declarations.py` by `make docs-ops`; `Backend`'s docstrings give the shapes.",
             "A tied argument (`=`) must match the size of the tensors before it. An op writes only the",
             "arguments its row names; every other argument is read only (the contract tier checks it).", "",
             "| op | arguments | returns | strict value rules |", "|---|---|---|---|"]
    for decl in DECLARATIONS:
        for method, args in decl.methods().items():
            listed = ", ".join(f"`{a.name}`{'=' if a.tied else ''} {a.kind}" for a in args)
            if method != decl.name:
                lines.append(f"| `{method}` | {listed} | the layout `{decl.name}` reads | |")
                continue
            returns = ", ".join(f"`{o}`" for o in decl.outputs) or f"nothing (writes `{', '.join(decl.writes)}`)"
            lines.append(f"| `{method}`: {decl.summary} | {listed} | {returns} | {'; '.join(decl.rules)} |")
    return "\n".join(lines) + "\n"
