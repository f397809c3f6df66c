"""Contract tier, strict mode: the value checks that read data (ranges, distinct destinations,
disjoint rows, tree masks and links, distributions and coins, the slots attention reads) refuse
bad values with a ContractError naming the op and the argument, and change nothing. These tests
skip on a ``strict=False`` instance, where such input is undefined behaviour."""

from __future__ import annotations

import pytest
import torch

from . import cases
from .checks import rejects
from .test_tree_verify import links_of, tree_mask_of

conformance = pytest.mark.conformance


@pytest.fixture
def strict_backend(backend):
    if not backend.strict:
        pytest.skip("value checks run only with strict=True")
    return backend


def _with(call: cases.Call, name: str, at, value) -> cases.Call:
    """``call`` with entry ``at`` of tensor argument ``name`` set to ``value``."""
    bad = call.args[name].clone()
    bad[at] = value
    return call.replace(**{name: bad})


# ---------------------------------------------------------------- allocation and cache locations

@conformance(tier="contract", op="alloc_extend")
def test_alloc_extend_bad_lengths(strict_backend, device):
    call = cases.minimal("alloc_extend", device, strict_backend)
    rejects(strict_backend, call.replace(num_new_tokens=call.args["num_new_tokens"] + 1), "num_new_tokens",
            "a token count off by one")
    rejects(strict_backend, _with(call, "prefix_lens", 0, int(call.args["seq_lens"][0]) + 1), "seq_lens",
            "a prefix longer than its sequence")


@conformance(tier="contract", op="alloc_extend")
def test_alloc_extend_too_few_pages(strict_backend, device):
    call = cases.minimal("alloc_extend", device, strict_backend)
    need = call.args["free_pages"].numel() - 2  # the minimal call holds 2 spare pages
    short = call.args["free_pages"][:max(need - 1, 0)].contiguous()
    rejects(strict_backend, call.replace(free_pages=short), "free_pages", "one page short")


@conformance(tier="contract", op="assign_req_to_token")
def test_assign_wrong_locs_count(strict_backend, device):
    call = cases.minimal("assign_req_to_token", device, strict_backend)
    rejects(strict_backend, call.replace(locs=call.args["locs"][:-1].contiguous()), "locs", "one loc short")


@conformance(tier="contract", op="assign_req_to_token")
def test_assign_overlapping_rows(strict_backend, device):
    """Two requests writing overlapping ranges of one row: the result would depend on write order."""
    call = cases.Call("assign_req_to_token", {
        "req_to_token": torch.full((3, 8), -1, dtype=torch.int64, device=device),
        "req_pool_indices": cases.index([1, 2, 1], device), "start": cases.index([0, 0, 3], device),
        "end": cases.index([4, 2, 6], device), "locs": cases.index(list(range(9)), device)})
    rejects(strict_backend, call, "req_pool_indices", "rows 0 and 2 both writing column 3")


REQ_RANGE_OPS = [pytest.param(op, marks=conformance(op=op)) for op in ("assign_req_to_token", "gather_cache_locs")]
"""The ops that take ranges ``start .. end`` of request-table rows."""


@conformance(tier="contract")
@pytest.mark.parametrize("op", REQ_RANGE_OPS)
@pytest.mark.parametrize("arg", ["req_pool_indices", "start", "end"])
def test_req_rows_out_of_range(strict_backend, device, op, arg):
    call = cases.minimal(op, device, strict_backend)
    R, M = call.args["req_to_token"].shape
    rejects(strict_backend, _with(call, arg, 0, R if arg == "req_pool_indices" else M + 1), arg, f"{arg} out of range")


@conformance(tier="contract", op="gather_cache_locs")
def test_gather_wrong_count(strict_backend, device):
    call = cases.minimal("gather_cache_locs", device, strict_backend)
    rejects(strict_backend, call.replace(num_tokens=call.args["num_tokens"] + 1), "num_tokens", "a count off by one")


# ---------------------------------------------------------------- KV

@conformance(tier="contract", op="store_kv")
@pytest.mark.parametrize("where", ["past_end", "below_sentinel"])
def test_store_kv_out_of_range(strict_backend, device, where):
    call = cases.minimal("store_kv", device, strict_backend)
    value = call.args["kv"].num_slots if where == "past_end" else -2
    rejects(strict_backend, _with(call, "locs", 0, value), "locs", f"loc {value}")


@conformance(tier="contract", op="store_kv")
def test_store_kv_duplicate(strict_backend, device):
    call = cases.minimal("store_kv", device, strict_backend)
    live = (call.args["locs"] != -1).nonzero().reshape(-1).tolist()
    rejects(strict_backend, _with(call, "locs", live[1], int(call.args["locs"][live[0]])), "locs", "a repeated loc")


@conformance(tier="contract", op="move_kv")
@pytest.mark.parametrize("arg", ["src", "dst"])
def test_move_kv_out_of_range(strict_backend, device, arg):
    call = cases.minimal("move_kv", device, strict_backend)
    rejects(strict_backend, _with(call, arg, 0, call.args["kv"].num_slots + 3), arg, f"{arg} past the last slot")


@conformance(tier="contract", op="move_kv")
def test_move_kv_duplicate_dst(strict_backend, device):
    kv = cases.minimal("move_kv", device, strict_backend).args["kv"]
    call = cases.Call("move_kv", {"kv": kv, "src": cases.index([1, 2, 3], device), "dst": cases.index([5, 6, 5], device)})
    rejects(strict_backend, call, "dst", "two moves into one slot")


@conformance(tier="contract", op="accepted_kv_moves")
def test_accepted_kv_moves_index_out_of_range(strict_backend, device):
    call = cases.minimal("accepted_kv_moves", device, strict_backend)
    rejects(strict_backend, _with(call, "accept_index", (0, 0), call.args["accept_index"].numel()), "accept_index",
            "an accept index past the last node")


@conformance(tier="contract", op="accepted_kv_moves")
def test_accepted_kv_moves_index_of_another_request(strict_backend, device):
    """Row b of accept_index may name only request b's nodes (flat ids b*D .. b*D + D - 1)."""
    call = cases.minimal("accepted_kv_moves", device, strict_backend)
    D = call.args["accept_index"].shape[1]
    rejects(strict_backend, _with(call, "accept_index", (1, 0), 0), "accept_index",
            f"request 1 accepting node 0 of request 0 (D = {D})")


# ---------------------------------------------------------------- tree and verify

# One flipped entry of the mask of parents [-1, 0, 0, 1]: (b, i, j) -> new value.
MALFORMED = {
    "missing_diagonal": ((0, 2, 2), False),
    "child_before_parent": ((0, 1, 2), True),
    "root_sees_child": ((0, 0, 1), True),
    "misses_root": ((0, 3, 0), False),
    "ancestors_not_a_chain": ((0, 3, 2), True),
}


@conformance(tier="contract")
@pytest.mark.parametrize("method", [pytest.param(m, marks=conformance(op=cases.OP_OF[m]))
                                    for m in ("reconstruct_tree", "attention_layout")])
@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_tree_rejected(strict_backend, device, method, case):
    """A mask that is not a tree listing parents before children is refused."""
    entry, value = MALFORMED[case]
    mask = torch.tensor([tree_mask_of([-1, 0, 0, 1])], dtype=torch.bool, device=device)
    mask[entry] = value
    if method == "reconstruct_tree":
        call = cases.Call(method, {"tree_mask": mask, "seq_lens": cases.index([3], device)})
    else:
        table = cases.index([list(range(8))], device)
        call = cases.Call("attention", {"req_to_token": table, "req_pool_indices": cases.index([0], device),
                                        "kv_lens": cases.index([7], device), "q_lens": cases.index([4], device),
                                        "num_queries": 4, "tree_mask": mask}, method=method)
    rejects(strict_backend, call, "tree_mask", case)


@conformance(tier="contract")
@pytest.mark.parametrize("method", [pytest.param(m, marks=conformance(op=cases.OP_OF[m]))
                                    for m in ("reconstruct_tree", "attention_layout")])
def test_any_topological_order_accepted(strict_backend, device, method):
    """Parents before children is the whole rule: a depth-first order is as valid as BFS."""
    dfs = [-1, 0, 1, 1, 0, 4]
    mask = torch.tensor([tree_mask_of(dfs)], dtype=torch.bool, device=device)
    if method == "reconstruct_tree":
        strict_backend.reconstruct_tree(mask, cases.index([2], device))
    else:
        strict_backend.attention_layout(cases.index([list(range(8))], device), cases.index([0], device),
                                        cases.index([8], device), cases.index([6], device), 6, mask, 8)


# (argument, request, node, new value) of a valid 4-node tree [-1, 0, 0, 1] in two requests.
BROKEN_LINKS = {
    "points_back": ("retrieve_next_token", 0, 3, 1),
    "points_past_the_tree": ("retrieve_next_token", 1, 0, 4),
    "root_has_a_sibling": ("retrieve_next_sibling", 0, 0, 2),
    "node_reached_twice": ("retrieve_next_token", 0, 2, 3),
    "node_unreached": ("retrieve_next_token", 1, 1, -1),
}
VERIFY_OPS = [pytest.param(op, marks=conformance(op=op)) for op in ("verify_tree_greedy", "verify_tree_sample")]


def _verify_call(op: str, device) -> cases.Call:
    index, first, sibling = links_of([[-1, 0, 0, 1]] * 2, device)
    args = {"candidates": cases.index([[0, 1, 2, 3], [3, 2, 1, 0]], device), "retrieve_index": index,
            "retrieve_next_token": first, "retrieve_next_sibling": sibling}
    if op == "verify_tree_greedy":
        return cases.Call(op, {**args, "target_predict": cases.index([[1, 3, 0, 2], [2, 0, 1, 3]], device)})
    return cases.Call(op, {**args, "target_probs": torch.full((2, 4, 4), 0.25, device=device),
                           "uniform_samples": torch.full((2, 4), 0.5, device=device),
                           "uniform_final": torch.full((2,), 0.5, device=device)})


@conformance(tier="contract")
@pytest.mark.parametrize("op", VERIFY_OPS)
@pytest.mark.parametrize("case", sorted(BROKEN_LINKS))
def test_links_not_a_tree_rejected(strict_backend, device, op, case):
    """Retrieve links that do not form a tree listing parents before children are refused."""
    arg, b, i, value = BROKEN_LINKS[case]
    rejects(strict_backend, _with(_verify_call(op, device), arg, (b, i), value), arg, case)


@conformance(tier="contract")
@pytest.mark.parametrize("op", VERIFY_OPS)
def test_retrieve_index_out_of_range(strict_backend, device, op):
    rejects(strict_backend, _with(_verify_call(op, device), "retrieve_index", (1, 3), 8), "retrieve_index",
            "a flat id past B*D")


# (argument, index, value) of the sampling call above.
BAD_SAMPLING = {
    "probs_sum_below_one": ("target_probs", (1, 2, 0), 0.0),
    "probs_sum_above_one": ("target_probs", (0, 0, 3), 0.5),
    "negative_prob": ("target_probs", (0, 1, 1), -0.25),
    "nan_prob": ("target_probs", (0, 3, 2), float("nan")),
    "coin_is_one": ("uniform_samples", (1, 2), 1.0),
    "coin_below_zero": ("uniform_samples", (0, 1), -0.125),
    "final_coin_is_one": ("uniform_final", (1,), 1.0),
    "token_outside_vocab": ("candidates", (0, 2), 4),
}


@conformance(tier="contract", op="verify_tree_sample")
@pytest.mark.parametrize("case", sorted(BAD_SAMPLING))
def test_sampling_inputs_rejected(strict_backend, device, case):
    """Rows of target_probs are distributions (>= 0, summing to 1); coins lie in [0, 1); draft
    tokens are in the vocabulary."""
    arg, at, value = BAD_SAMPLING[case]
    rejects(strict_backend, _with(_verify_call("verify_tree_sample", device), arg, at, value), arg, case)


# ---------------------------------------------------------------- attention

@conformance(tier="contract", op="attention")
@pytest.mark.parametrize("method", ["attention", "attention_layout"])
def test_attention_bad_lengths(strict_backend, device, method):
    """q_lens <= kv_lens, max_kv_len >= max(kv_lens), and N = sum(q_lens)."""
    call = cases.minimal(method, device, strict_backend).replace(tree_mask=None)
    rejects(strict_backend, _with(call, "kv_lens", 1, 2), "q_lens", "a request with more queries than keys")
    rejects(strict_backend, call.replace(max_kv_len=4), "max_kv_len", "max_kv_len below max(kv_lens)")
    if method == "attention_layout":
        rejects(strict_backend, call.replace(num_queries=5), "q", "one query row short")
    else:
        rejects(strict_backend, call.replace(q=call.args["q"][:5].contiguous()), "q", "one query row short")


@conformance(tier="contract", op="attention")
@pytest.mark.parametrize("method", ["attention", "attention_layout"])
def test_attention_tree_needs_d_queries_each(strict_backend, device, method):
    """With a tree mask every request has exactly D queries; only their sum matching is not enough."""
    call = cases.minimal(method, device, strict_backend)
    q_lens = cases.index([4, 2], device)  # D = 3 each, same sum
    rejects(strict_backend, call.replace(q_lens=q_lens), "q_lens", "q_lens [4, 2] with D = 3")


@conformance(tier="contract", op="attention")
@pytest.mark.parametrize("method", ["attention", "attention_layout"])
def test_attention_reads_a_sentinel_slot(strict_backend, device, method):
    """Every cell attention reads (``req_to_token[r_b, :kv_lens[b]]``) holds a slot."""
    call = cases.minimal(method, device, strict_backend)
    rejects(strict_backend, _with(call, "req_to_token", (2, 1), -1), "req_to_token", "a -1 inside kv_lens")


@conformance(tier="contract", op="attention")
def test_attention_reads_past_the_cache(strict_backend, device):
    """A slot read past the cache's last is refused when the layer runs."""
    call = cases.minimal("attention", device, strict_backend)
    num_slots = call.args["kv"].num_slots
    rejects(strict_backend, _with(call, "req_to_token", (0, 4), num_slots), "req_to_token", f"slot {num_slots} read")


# ---------------------------------------------------------------- value rules stated in backend.py, one test each

@conformance(tier="contract", op="alloc_extend")
def test_alloc_extend_negative_prefix(strict_backend, device):
    call = cases.minimal("alloc_extend", device, strict_backend)
    rejects(strict_backend, _with(call, "prefix_lens", 0, -1), "seq_lens", "a negative prefix length")


@conformance(tier="contract", op="alloc_extend")
def test_alloc_extend_sentinel_last_loc_after_a_prefix(strict_backend, device):
    call = cases.minimal("alloc_extend", device, strict_backend)
    held = [b for b, n in enumerate(call.args["prefix_lens"].tolist()) if n > 0]
    assert held, "the minimal call must hold a request with a prefix"
    rejects(strict_backend, _with(call, "last_loc", held[0], -1), "last_loc", "-1 for a request holding slots")


@conformance(tier="contract", op="alloc_extend")
@pytest.mark.parametrize("case", ["negative", "repeated"])
def test_alloc_extend_bad_free_pages(strict_backend, device, case):
    call = cases.minimal("alloc_extend", device, strict_backend)
    value = -1 if case == "negative" else int(call.args["free_pages"][1])
    rejects(strict_backend, _with(call, "free_pages", 0, value), "free_pages", f"a {case} free page")


@conformance(tier="contract")
@pytest.mark.parametrize("op", REQ_RANGE_OPS)
def test_req_range_ends_before_it_starts(strict_backend, device, op):
    call = cases.minimal(op, device, strict_backend)
    M = call.args["req_to_token"].shape[1]
    end = int(call.args["end"][0])
    bad = call.replace(start=call.args["start"].clone(), end=call.args["end"].clone())
    bad.args["start"][0], bad.args["end"][0] = min(end + 1, M), min(end + 1, M) - 1
    rejects(strict_backend, bad, "end", "end before start")


@conformance(tier="contract", op="accepted_kv_moves")
@pytest.mark.parametrize("case", ["row_out_of_range", "seq_len_past_the_row", "negative_seq_len"])
def test_accepted_kv_moves_bad_rows_and_lengths(strict_backend, device, case):
    call = cases.minimal("accepted_kv_moves", device, strict_backend)
    R, M = call.args["req_to_token"].shape
    if case == "row_out_of_range":
        rejects(strict_backend, _with(call, "req_pool_indices", 0, R), "req_pool_indices", "a row past the table")
    else:
        rejects(strict_backend, _with(call, "seq_lens", 0, M if case == "seq_len_past_the_row" else -1), "seq_lens",
                "a tree that does not fit its row" if case == "seq_len_past_the_row" else "a negative length")


@conformance(tier="contract", op="reconstruct_tree")
def test_reconstruct_tree_negative_seq_len(strict_backend, device):
    call = cases.minimal("reconstruct_tree", device, strict_backend)
    rejects(strict_backend, _with(call, "seq_lens", 0, -1), "seq_lens", "a negative length")


@conformance(tier="contract", op="attention")
@pytest.mark.parametrize("method", ["attention", "attention_layout"])
@pytest.mark.parametrize("case", ["row_out_of_range", "keys_past_the_row", "negative_queries"])
def test_attention_bad_rows_and_lengths(strict_backend, device, method, case):
    call = cases.minimal(method, device, strict_backend).replace(tree_mask=None)
    R, M = call.args["req_to_token"].shape
    if case == "row_out_of_range":
        rejects(strict_backend, _with(call, "req_pool_indices", 0, R), "req_pool_indices", "a row past the table")
    elif case == "keys_past_the_row":
        bad = _with(call, "kv_lens", 0, M + 1).replace(max_kv_len=M + 1)
        rejects(strict_backend, bad, "kv_lens", "more keys than the row holds")
    else:
        q_lens = call.args["q_lens"].clone()
        q_lens[0], q_lens[1] = -1, q_lens[1] + q_lens[0] + 1  # the same total
        rejects(strict_backend, call.replace(q_lens=q_lens), "q_lens", "a negative query count")
