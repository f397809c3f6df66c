"""A tiny Llama configuration and a session over one KV cache and request table, shared by the
model tests of the engine and of the Triton backends."""

from __future__ import annotations

import random

import torch

from ngram_hal.engine.config import LlamaConfig
from ngram_hal.engine.model import ForwardBatch, LlamaModel

SLOTS = 512
ROWS = 8
MAX_CONTEXT = 128
TINY = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-5,
                   max_position_embeddings=256, bos_token_id=1, eos_token_id=2)


def index_tensor(values, device="cpu") -> torch.Tensor:
    """An int64 tensor of ``values`` on ``device``."""
    return torch.tensor(values, dtype=torch.int64, device=device)


class Session:
    """One KV cache and request table, with slots handed out in a scattered order."""

    def __init__(self, model: LlamaModel, seed: int = 0):
        self.model = model
        self.kv = model.new_kv_cache(SLOTS)
        self.device = model.device
        self.table = torch.full((ROWS, MAX_CONTEXT), -1, dtype=torch.int64, device=self.device)
        self.free = random.Random(seed).sample(range(SLOTS), SLOTS)
        self.lens = [0] * ROWS

    def take(self, n: int) -> list[int]:
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def extend(self, requests: list[tuple[int, list[int]]], logits_index=None) -> torch.Tensor:
        """Append ``ids`` to each ``(row, ids)`` in one forward; causal attention."""
        ids, pos, locs, kv_lens, q_lens = [], [], [], [], []
        for row, new in requests:
            start = self.lens[row]
            slots = self.take(len(new))
            self.table[row, start:start + len(new)] = index_tensor(slots, self.device)
            self.lens[row] = start + len(new)
            ids += new
            pos += list(range(start, start + len(new)))
            locs += slots
            kv_lens.append(self.lens[row])
            q_lens.append(len(new))
        dev = self.device
        batch = ForwardBatch(input_ids=index_tensor(ids, dev), positions=index_tensor(pos, dev), out_cache_loc=index_tensor(locs, dev),
                             req_to_token=self.table, req_pool_indices=index_tensor([r for r, _ in requests], dev),
                             kv_lens=index_tensor(kv_lens, dev), q_lens=index_tensor(q_lens, dev), max_kv_len=max(kv_lens),
                             logits_index=logits_index)
        return self.model.forward(batch, self.kv)

    def fork(self, src: int, dst: int) -> None:
        """Row ``dst`` shares row ``src``'s cached prefix (same slots)."""
        self.table[dst] = self.table[src]
        self.lens[dst] = self.lens[src]

    def tree(self, rows: list[int], tokens: list[list[int]], parents: list[int], chains: bool = False) -> torch.Tensor:
        """Verify one draft tree (same shape for every row) after each row's cached tokens; ``chains``:
        the forward is told the tree is a chain (``ForwardBatch.chains``)."""
        D = len(parents)
        mask = torch.zeros(D, D, dtype=torch.bool)
        depth = [0] * D
        for i, p in enumerate(parents):
            if p >= 0:
                mask[i] = mask[p]
                depth[i] = depth[p] + 1
            mask[i, i] = True
        pos, locs, kv_lens = [], [], []
        for row in rows:
            seq = self.lens[row]
            slots = self.take(D)
            self.table[row, seq:seq + D] = index_tensor(slots, self.device)
            pos += [seq + d for d in depth]
            locs += slots
            kv_lens.append(seq + D)
        dev = self.device
        batch = ForwardBatch(input_ids=index_tensor([t for row_tokens in tokens for t in row_tokens], dev),
                             positions=index_tensor(pos, dev), out_cache_loc=index_tensor(locs, dev), req_to_token=self.table,
                             req_pool_indices=index_tensor(rows, dev), kv_lens=index_tensor(kv_lens, dev),
                             q_lens=index_tensor([D] * len(rows), dev),
                             tree_mask=mask.expand(len(rows), D, D).contiguous().to(dev), chains=chains,
                             max_kv_len=max(kv_lens))
        return self.model.forward(batch, self.kv)
