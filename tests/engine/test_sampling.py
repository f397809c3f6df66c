"""Random numbers by position (the counter-based hash behind every sampled token) and the
inverse-CDF draw, whose cumulative sums give a row the same bits in any batch."""

from __future__ import annotations

import pytest
import torch

from ngram_hal.engine.sampling import FIXED_BITS, fixed_point, positional_uniforms, sample_from_probs, seed_bits

MASK = (1 << 64) - 1
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _splitmix(z: int) -> int:
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & MASK
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & MASK
    return z ^ (z >> 31)


def _reference(seed: int, position: int) -> float:
    """The same hash in Python's unbounded ints, reduced modulo 2**64 by hand."""
    z = _splitmix((seed + 0x9E3779B97F4A7C15) & MASK)
    z = _splitmix((z + position * 0x9E3779B97F4A7C15) & MASK)
    return (z >> 40) / (1 << 24)


def test_uniforms_are_the_hash_of_seed_and_position():
    seeds = [0, 1, 12345, 2**63 - 1, 2**63, 2**64 - 1]
    positions = [0, 1, 5, 2047, 10**6, 3]
    got = positional_uniforms(torch.tensor([seed_bits(s) for s in seeds]), torch.tensor(positions))
    assert got.dtype == torch.float32
    assert got.tolist() == [_reference(s, p) for s, p in zip(seeds, positions)]


def test_uniforms_do_not_depend_on_the_batch():
    seeds = torch.tensor([seed_bits(7)] * 5 + [seed_bits(8)] * 5)
    positions = torch.arange(10) % 5
    together = positional_uniforms(seeds, positions)
    alone = torch.cat([positional_uniforms(seeds[i:i + 1], positions[i:i + 1]) for i in range(10)])
    assert torch.equal(together, alone)
    assert not torch.equal(together[:5], together[5:])  # another seed, other numbers


def test_uniforms_look_uniform():
    u = positional_uniforms(torch.full((200_000,), seed_bits(3)), torch.arange(200_000))
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    counts = torch.histc(u, bins=10, min=0.0, max=1.0)
    assert float((counts - 20_000).abs().max()) < 600  # about 4 standard deviations
    lag = torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1]
    assert abs(float(lag)) < 0.01


def test_inverse_cdf_sampling_follows_the_distribution():
    probs = torch.tensor([[0.1, 0.6, 0.3]]).expand(50_000, 3)
    tokens = sample_from_probs(probs, positional_uniforms(torch.full((50_000,), seed_bits(1)), torch.arange(50_000)))
    freq = torch.bincount(tokens, minlength=3).float() / 50_000
    torch.testing.assert_close(freq, probs[0], atol=0.01, rtol=0)


def test_a_token_of_weight_zero_is_never_drawn():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).expand(4096, 5)
    tokens = sample_from_probs(probs, positional_uniforms(torch.full((4096,), seed_bits(2)), torch.arange(4096)))
    assert set(tokens.tolist()) == {1, 3}
    edges = torch.tensor([0.0, 1.0 - 2.0 ** -24])  # the smallest and the largest uniform
    assert sample_from_probs(probs[:2], edges).tolist() == [1, 3]


@pytest.mark.parametrize("device", DEVICES)
def test_a_rows_draw_does_not_depend_on_the_batch(device):
    """Bit for bit by design (integer sums): a plain decoding step samples one row where a verify
    step samples many, and a seeded request must draw the same token from the same logits."""
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(300, 49_152, generator=g) * 4, dim=-1).to(device)  # a vocabulary's width
    uniforms = positional_uniforms(torch.full((300,), seed_bits(5)), torch.arange(300)).to(device)
    tokens = sample_from_probs(probs, uniforms)
    sums = fixed_point(probs).cumsum(-1)
    for rows in (1, 2, 9, 64):
        assert torch.equal(sample_from_probs(probs[:rows], uniforms[:rows]), tokens[:rows]), f"{rows} rows"
        assert torch.equal(fixed_point(probs[:rows]).cumsum(-1), sums[:rows]), f"{rows} rows"
    assert int(sums[:, -1].max()) < 2 ** (FIXED_BITS + 1)
    torch.testing.assert_close(sums.double() / 2 ** FIXED_BITS, probs.double().cumsum(-1), rtol=0, atol=1e-6)
