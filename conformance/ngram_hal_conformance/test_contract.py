"""Contract tier, metadata: every tensor argument of every op (``attention_layout`` included) of a
wrong dtype, rank, size, layout or device raises ContractError naming the op and the argument,
with every tensor the op could touch left as it was; bad host scalars likewise; outputs are
int64 (or q's dtype), contiguous, on the device, of the documented shapes; an attention layout
serves only the backend and the tensors it was built for."""

from __future__ import annotations

import pytest
import torch

from . import cases
from .checks import assert_index_output, assert_unchanged, non_contiguous, other_device, rejects, snapshot

conformance = pytest.mark.conformance

ARGS = [pytest.param(method, arg, marks=conformance(op=cases.OP_OF[method]), id=f"{method}-{arg}")
        for method, args in cases.TENSOR_ARGS.items() for arg in args]
TIED_ARGS = [pytest.param(method, arg, marks=conformance(op=cases.OP_OF[method]), id=f"{method}-{arg}")
             for method, args in cases.TIED_ARGS.items() for arg in args]
BAD_DTYPES = {"index": (torch.int32, torch.float32), "mask": (torch.int64, torch.uint8),
              "float": (torch.float64, torch.int64)}
DTYPE_ARGS = [pytest.param(method, arg, dtype, marks=conformance(op=cases.OP_OF[method]),
                           id=f"{method}-{arg}-{str(dtype).removeprefix('torch.')}")
              for method, args in cases.TENSOR_ARGS.items() for arg, kind in args.items() for dtype in BAD_DTYPES[kind]]


@conformance(tier="contract")
@pytest.mark.parametrize("method,arg,dtype", DTYPE_ARGS)
def test_dtype_rejected(backend, device, method, arg, dtype):
    """A tensor argument of a wrong dtype (int32 or float32 indices, int64 or uint8 masks,
    float64 or int64 floats) is refused, never cast."""
    call = cases.minimal(method, device, backend)
    rejects(backend, call.replace(**{arg: call.args[arg].to(dtype)}), arg, f"{arg} as {dtype}")


@conformance(tier="contract")
@pytest.mark.parametrize("method,arg", ARGS)
def test_rank_rejected(backend, device, method, arg):
    """A tensor argument with one axis too many is refused."""
    call = cases.minimal(method, device, backend)
    rejects(backend, call.replace(**{arg: call.args[arg].unsqueeze(0)}), arg, f"{arg} of rank +1")


@conformance(tier="contract")
@pytest.mark.parametrize("method,arg", TIED_ARGS)
def test_length_rejected(backend, device, method, arg):
    """An argument whose size is tied to another's is refused when one entry (row) short."""
    call = cases.minimal(method, device, backend)
    rejects(backend, call.replace(**{arg: call.args[arg][:-1].contiguous()}), arg, f"{arg} one entry short")


@conformance(tier="contract")
@pytest.mark.parametrize("method,arg", ARGS)
def test_layout_rejected(backend, device, method, arg):
    """A non-contiguous tensor argument is refused (not copied into a contiguous one)."""
    call = cases.minimal(method, device, backend)
    rejects(backend, call.replace(**{arg: non_contiguous(call.args[arg])}), arg, f"non-contiguous {arg}")


@conformance(tier="contract")
@pytest.mark.parametrize("method,arg", ARGS)
def test_device_rejected(backend, device, method, arg):
    """A tensor argument on another device type is refused (not moved)."""
    call = cases.minimal(method, device, backend)
    moved = call.args[arg].to(other_device(device))
    rejects(backend, call.replace(**{arg: moved}), arg, f"{arg} on {moved.device}")


@conformance(tier="contract", op="store_kv")
@pytest.mark.parametrize("name", ["k", "v"])
def test_store_kv_rows_dtype_rejected(backend, device, name):
    """K/V rows of another float dtype than the cache's are refused, never cast."""
    call = cases.minimal("store_kv", device, backend)
    other = torch.float16 if call.args["kv"].dtype != torch.float16 else torch.float32
    rejects(backend, call.replace(**{name: call.args[name].to(other)}), name, f"{name} as {other}")


# (method, argument, bad value): host scalars and the KV cache.
SCALARS = [
    ("alloc_extend", "page_size", 0),
    ("alloc_extend", "num_new_tokens", -1),
    ("gather_cache_locs", "num_tokens", 2.0),
    ("store_kv", "layer", 2),
    ("store_kv", "kv", "cache"),
    ("move_kv", "kv", None),
    ("attention_layout", "num_queries", -1),
    ("attention_layout", "max_kv_len", "5"),
    ("attention", "layer", -1),
    ("attention", "sm_scale", "0.5"),
]


@conformance(tier="contract")
@pytest.mark.parametrize("method,arg,value", [
    pytest.param(m, a, v, marks=conformance(op=cases.OP_OF[m]), id=f"{m}-{a}") for m, a, v in SCALARS])
def test_scalar_rejected(backend, device, method, arg, value):
    """A host argument of the wrong type or out of range (a layer past the cache's last, a page
    size of 0, a count below 0, a tensor where a host int goes) is refused by name."""
    call = cases.minimal(method, device, backend)
    rejects(backend, call.replace(**{arg: value}), arg, f"{arg}={value!r}")


# ---------------------------------------------------------------- outputs

def _output_shapes(call: cases.Call) -> dict[str, tuple[int, ...]]:
    """The documented shapes of the outputs of ``call``, in order."""
    a, op = call.args, call.op
    if op == "alloc_extend":
        return {"slots": (a["num_new_tokens"],)}
    if op == "gather_cache_locs":
        return {"locs": (a["num_tokens"],)}
    if op == "accepted_kv_moves":
        return {"src": (a["accept_index"].numel(),), "dst": (a["accept_index"].numel(),)}
    if op == "reconstruct_tree":
        B, D = a["tree_mask"].shape[:2]
        return {"positions": (B * D,), "retrieve_index": (B, D), "retrieve_next_token": (B, D),
                "retrieve_next_sibling": (B, D)}
    B, D = a["candidates"].shape
    return {"predicts": (B * D,), "accept_index": (B, D), "accept_len": (B,)}


VALUE_OPS = ("alloc_extend", "gather_cache_locs", "accepted_kv_moves", "reconstruct_tree", "verify_tree_greedy",
             "verify_tree_sample")


@conformance(tier="contract")
@pytest.mark.parametrize("op", [pytest.param(op, marks=conformance(op=op)) for op in VALUE_OPS])
def test_outputs(backend, device, op):
    """Index outputs are int64, contiguous, on the backend's device, of the documented shapes."""
    call = cases.minimal(op, device, backend)
    out = call.run(backend)
    shapes = _output_shapes(call)
    outs = (out,) if len(shapes) == 1 else out
    assert isinstance(outs, tuple) and len(outs) == len(shapes), f"{op} returns ({', '.join(shapes)})"
    for t, (name, shape) in zip(outs, shapes.items()):
        assert_index_output(t, device, shape, f"{op} {name}")


@conformance(tier="contract", op="attention")
def test_attention_output(backend, device):
    """Attention returns a new contiguous tensor of q's shape and dtype on the backend's device."""
    call = cases.minimal("attention", device, backend)
    q = call.args["q"]
    out = call.run(backend)
    assert isinstance(out, torch.Tensor), f"attention returned {type(out).__name__}"
    assert out.dtype == q.dtype and tuple(out.shape) == tuple(q.shape), (
        f"attention output {out.dtype}{tuple(out.shape)}, q is {q.dtype}{tuple(q.shape)}")
    assert out.is_contiguous() and out.device.type == torch.device(device).type


@conformance(tier="contract")
@pytest.mark.parametrize("op", [pytest.param(op, marks=conformance(op=op))
                                for op, written in cases.WRITES.items() if written])
def test_in_place_ops_return_none(backend, device, op):
    """The ops that write in place return nothing."""
    assert cases.minimal(op, device, backend).run(backend) is None, f"{op} must return None"


@conformance(tier="contract")
@pytest.mark.parametrize("method", [pytest.param(m, marks=conformance(op=cases.OP_OF[m])) for m in cases.TENSOR_ARGS])
def test_inputs_are_read_only(backend, device, method):
    """A valid call leaves every argument its op does not write (``writes`` in the op's
    declaration) bit for bit as it was: no input doubles as scratch."""
    call = cases.minimal(method, device, backend)
    written = cases.WRITES[call.op] if method == call.op else ()
    kept = {name: t for name, t in call.state().items() if name.split(".")[0] not in written}
    before = snapshot(kept)
    call.run(backend)
    kv = call.args.get("kv")
    assert_unchanged(before, kept, f"{method} (a valid call)", getattr(kv, "num_slots", None))


@conformance(tier="contract", op="gather_cache_locs")
def test_gather_cache_locs_without_count(backend, device):
    """num_tokens may be omitted (the op then derives it, a host sync)."""
    call = cases.minimal("gather_cache_locs", device, backend)
    n = call.args["num_tokens"]
    out = call.replace(num_tokens=None).run(backend)
    assert_index_output(out, device, (n,), "gather_cache_locs output")


# ---------------------------------------------------------------- the attention layout

def _layout(backend, call: cases.Call):
    a = call.args
    return backend.attention_layout(a["req_to_token"], a["req_pool_indices"], a["kv_lens"], a["q_lens"],
                                    a["q"].shape[0], a["tree_mask"], a["max_kv_len"])


@conformance(op="attention", tier="contract")
@pytest.mark.parametrize("builder", ["reference", "other-instance"])
def test_layout_of_another_backend_rejected(backend, reference, device, builder):
    """A layout built by another backend instance is refused by name, even over the same tensors."""
    call = cases.minimal("attention", device, backend)
    other = reference if builder == "reference" else type(backend)(device=device, strict=backend.strict)
    rejects(backend, call.replace(layout=_layout(other, call)), "layout", f"a layout built by {other!r}")


@conformance(op="attention", tier="contract")
@pytest.mark.parametrize("name", ["req_to_token", "req_pool_indices", "kv_lens", "q_lens", "tree_mask", "q"])
def test_layout_over_other_tensors_rejected(backend, device, name):
    """A layout is refused with tensors it was not built over (equal copies included), or with a
    ``q`` of another row count."""
    call = cases.minimal("attention", device, backend)
    layout = _layout(backend, call)
    value = call.args[name]
    other = value[:-1].contiguous() if name == "q" else value.clone()
    rejects(backend, call.replace(layout=layout, **{name: other}), "layout", f"a layout built over another {name}")


@conformance(op="attention", tier="contract")
def test_layout_must_be_a_layout(backend, device):
    call = cases.minimal("attention", device, backend)
    rejects(backend, call.replace(layout={"plan": None}), "layout", "a dict as the layout")


@conformance(op="attention", tier="contract")
def test_layout_serves_every_layer(backend, device):
    """One layout passed to each layer's call gives the result of a call that builds its own."""
    call = cases.minimal("attention", device, backend)
    layout = _layout(backend, call)
    before = snapshot(call.state())
    for layer in range(call.args["kv"].num_layers):
        shared = call.replace(layer=layer, layout=layout).run(backend)
        own = call.replace(layer=layer).run(backend)
        assert torch.equal(shared.cpu(), own.cpu()), f"layer {layer}: the shared layout changes the result"
    assert_unchanged(before, call.state(), "attention", call.args["kv"].num_slots)
