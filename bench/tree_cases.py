"""Ready-to-run argument sets for the tree and verify ops at the size of one speculative step.

``tree_verify_cases(device, dtype)`` yields one :class:`TreeVerifyCase` per op for B = 64
requests of D = 16 draft nodes each in random BFS trees, with V = 49152 (SmolLM2's vocabulary)
for sampling. The targets agree with the drafts often enough for realistic acceptance: at a
node with children, the target's argmax is one child's token with probability ``agree``, and
its distribution puts a mass of 0.5 to 0.95 on that token. Everything is built on ``device``
from a seeded generator, so two backends timed on the same seed see the same inputs.

    from tree_cases import tree_verify_cases
    for case in tree_verify_cases("cuda", torch.bfloat16):
        case.run(backend)
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ngram_hal.reference.tree import reconstruct_tree
from ngram_hal_conformance.test_tree_verify import mask_of

I64 = torch.int64


@dataclass
class TreeVerifyCase:
    """One op's keyword arguments: ``getattr(backend, op)(**args)``."""

    name: str
    op: str
    args: dict[str, torch.Tensor]

    def run(self, backend):
        return getattr(backend, self.op)(**self.args)


def bfs_parents(rng: random.Random, tree_size: int) -> list[int]:
    """A random tree of ``tree_size`` nodes in BFS order as a parent list (-1 for the root): each node
    stays with the previous node's parent or moves on to a later node, so parents never decrease."""
    parents = [-1]
    for i in range(1, tree_size):
        low = max(parents[-1], 0)
        parents.append(low if i == 1 or rng.random() < 0.5 else rng.randint(low, i - 1))
    return parents


def tree_verify_cases(device, dtype: torch.dtype = torch.float32, batch: int = 64, tree_size: int = 16,
                      vocab: int = 49152, agree: float = 0.7, seed: int = 0) -> Iterator[TreeVerifyCase]:
    """``reconstruct_tree``, ``verify_tree_greedy`` and ``verify_tree_sample`` arguments.

    Args:
        device: where every tensor is built.
        dtype: of ``target_probs`` (float32, float16 or bfloat16); the coins are float32.
        batch, tree_size, vocab: B, D and V.
        agree: the chance that the target's choice at a node with children is a child's token.
        seed: seeds the trees, tokens and probabilities.
    """
    rng = random.Random(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    B, D, V = batch, tree_size, vocab
    parents = [bfs_parents(rng, D) for _ in range(B)]
    mask = mask_of(parents, device)
    seq_lens = torch.tensor([rng.randint(16, 4096) for _ in range(B)], dtype=I64, device=device)
    yield TreeVerifyCase(f"reconstruct_tree B={B} D={D}", "reconstruct_tree",
                         {"tree_mask": mask, "seq_lens": seq_lens})

    _, retrieve_index, next_token, next_sibling = reconstruct_tree(mask, seq_lens)
    links = {"retrieve_index": retrieve_index, "retrieve_next_token": next_token,
             "retrieve_next_sibling": next_sibling}
    candidates = torch.randint(0, V, (B, D), generator=gen, device=device)
    # The token the target favours after each node: a child's with probability ``agree``.
    chosen = [[-1] * D for _ in range(B)]
    for b, tree in enumerate(parents):
        for i in range(D):
            children = [j for j in range(D) if tree[j] == i]
            if children and rng.random() < agree:
                chosen[b][i] = rng.choice(children)
    child = torch.tensor(chosen, dtype=I64, device=device)
    favoured = torch.where(child >= 0, candidates.gather(1, child.clamp(min=0)),
                           torch.randint(0, V, (B, D), generator=gen, device=device))
    yield TreeVerifyCase(f"verify_tree_greedy B={B} D={D}", "verify_tree_greedy",
                         {"candidates": candidates, **links, "target_predict": favoured})

    weight = torch.empty(B, D, 1, device=device).uniform_(0.5, 0.95, generator=gen)
    probs = torch.softmax(2 * torch.randn(B, D, V, generator=gen, device=device), dim=-1) * (1 - weight)
    probs.scatter_add_(2, favoured.unsqueeze(-1), weight)
    yield TreeVerifyCase(f"verify_tree_sample B={B} D={D} V={V} {str(dtype).removeprefix('torch.')}",
                         "verify_tree_sample",
                         {"candidates": candidates, **links, "target_probs": probs.to(dtype),
                          "uniform_samples": torch.rand((B, D), generator=gen, device=device),
                          "uniform_final": torch.rand((B,), generator=gen, device=device)})
