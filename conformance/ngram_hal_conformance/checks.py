"""Assertions and tensor mutations shared by the conformance tests."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from ngram_hal.contract import ContractError, same_device

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu()


def assert_index_output(t, device, shape: tuple[int, ...], what: str) -> None:
    """An op's index output: an int64, contiguous tensor of ``shape`` on ``device``."""
    assert isinstance(t, torch.Tensor), f"{what}: expected a tensor, got {type(t).__name__}"
    assert t.dtype == torch.int64, f"{what}: dtype {t.dtype}, the contract requires torch.int64"
    assert t.is_contiguous(), f"{what}: not contiguous"
    assert same_device(t.device, device), f"{what}: on {t.device}, the backend runs on {device}"
    assert tuple(t.shape) == tuple(shape), f"{what}: shape {tuple(t.shape)}, expected {tuple(shape)}"


def assert_equal(actual: torch.Tensor, expected, what: str) -> None:
    """Exact equality of integer tensors, dtype included (a list stands for int64 values); the
    first mismatch is shown."""
    actual = host(actual)
    expected = host(expected) if isinstance(expected, torch.Tensor) else torch.tensor(expected, dtype=torch.int64)
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype}, expected {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    if not torch.equal(actual, expected):
        at = (actual != expected).reshape(-1).int().argmax().item()
        raise AssertionError(f"{what}: differs at flat index {at}: got {actual.reshape(-1)[at].item()}, "
                             f"expected {expected.reshape(-1)[at].item()}\n got {actual.tolist()}\n"
                             f"want {expected.tolist()}")


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Bit-exact equality of float tensors (so -0.0 vs 0.0 and NaN payloads count)."""
    actual, expected = host(actual), host(expected)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (
        f"{what}: {actual.dtype}{tuple(actual.shape)} vs {expected.dtype}{tuple(expected.shape)}")
    bits = _BITS[actual.element_size()]
    diff = actual.view(bits) != expected.view(bits)
    if bool(diff.any()):
        where = [tuple(i) for i in diff.nonzero()[:5].tolist()]
        raise AssertionError(f"{what}: {int(diff.sum())} elements differ, first at {where}")


def slots(cache: torch.Tensor, num_slots: int) -> torch.Tensor:
    """The data rows of a ``[L, S+1, H, d]`` K or V buffer (the scratch row is not data)."""
    return cache[:, :num_slots]


def snapshot(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Host copies of the state tensors that hold data (``meta`` tensors hold none)."""
    return {name: host(t).clone() for name, t in state.items() if t.device.type != "meta"}


def assert_unchanged(before: dict[str, torch.Tensor], state: dict[str, torch.Tensor], why: str,
                     num_slots: int | None = None) -> None:
    """Every state tensor still equals its snapshot bit for bit (NaN included; K/V compared on the
    data rows only)."""
    for name, old in before.items():
        new = host(state[name])
        if name.endswith((".k", ".v")) and num_slots is not None:
            old, new = old[:, :num_slots], new[:, :num_slots]
        if old.dtype.is_floating_point and old.dtype == new.dtype and old.shape == new.shape:
            old, new = old.view(_BITS[old.element_size()]), new.view(_BITS[new.element_size()])
        assert torch.equal(old, new), f"{why}: '{name}' was changed"


@contextmanager
def raises_contract(op: str, arg: str):
    """Expect a :class:`ContractError` that names ``op`` and the argument ``arg``."""
    with pytest.raises(ContractError) as info:
        yield info
    err = info.value
    assert err.op == op, f"ContractError names op '{err.op}', expected '{op}': {err}"
    assert err.arg == arg and not err.output, f"ContractError names '{err.arg}', expected argument '{arg}': {err}"
    assert op in str(err) and arg in str(err), f"message must name '{op}' and '{arg}': {err}"


def rejects(backend, call, arg: str, why: str) -> None:
    """``call`` raises a ContractError naming its op and ``arg``, and every tensor the op could
    touch (its tensor arguments and the KV cache) holds what it held before."""
    before = snapshot(call.state())
    with raises_contract(call.op, arg):
        call.run(backend)
    kv = call.args.get("kv")
    assert_unchanged(before, call.state(), f"{call.method or call.op} with {why}",
                     getattr(kv, "num_slots", None))


def non_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The same values in a strided (non-contiguous) layout; needs ``t.shape[-1] >= 2``."""
    assert t.shape[-1] >= 2, "a non-contiguous view needs at least two entries on the last axis"
    wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    view = wide[..., ::2]
    view.copy_(t)
    assert not view.is_contiguous()
    return view


def other_device(device: torch.device) -> torch.device:
    """A device of another type than ``device``: the CPU for an accelerator; for the CPU an
    accelerator when one is present, else ``meta`` (a real device type that holds metadata only,
    which is all a contract check may read)."""
    if device.type != "cpu":
        return torch.device("cpu")
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        return torch.device(accelerator.current_accelerator().type)
    return torch.device("meta")
