"""Settings: ``LlamaConfig``, the shape of a Llama-family model, and ``EngineConfig``, an engine's."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class LlamaConfig(BaseModel):
    """Hyper-parameters of a Llama-family decoder (read from a GGUF file or given for tests).

    ``num_heads`` query heads share ``num_kv_heads`` key/value heads (grouped-query attention);
    ``head_dim`` is the width of one head. ``rope_freq_factors`` scales the rotary embedding as a
    file states it: ``head_dim / 2`` divisors, one per frequency ``rope_theta ** (-2j / head_dim)``
    (llama.cpp's ``rope_freqs`` tensor for Llama 3.1's scaling; one factor everywhere for linear
    scaling); None for plain rotary embeddings.
    """

    model_config = ConfigDict(frozen=True)

    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    rope_theta: float = Field(default=10000.0, gt=0)
    rms_norm_eps: float = Field(default=1e-5, gt=0)
    max_position_embeddings: int = Field(default=2048, gt=0)
    tie_word_embeddings: bool = True
    rope_freq_factors: tuple[float, ...] | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    @model_validator(mode="after")
    def _check_shapes(self) -> "LlamaConfig":
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        factors = self.rope_freq_factors
        if factors is not None and (len(factors) != self.head_dim // 2 or not all(f > 0 for f in factors)):
            raise ValueError(f"rope_freq_factors: expected {self.head_dim // 2} positive factors (head_dim / 2), "
                             f"got {len(factors)}")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"{name} ({value}) outside the vocabulary [0, {self.vocab_size})")
        return self


class EngineConfig(BaseModel):
    """Engine settings.

    ``tree_size`` is the tree size D: the nodes of a request's draft tree per verify step, the root
    included; 1 turns speculation off.
    ``spec_policy="auto"`` lets each verify step use 1, 2, 4, ... or D nodes, whichever a cost
    model expects to commit the most tokens per second for the whole batch
    (:mod:`ngram_hal.engine.policy`); ``"always"`` uses D. With a host drafter
    (``"trie"``, ``"linear"``) a speculative step runs only as many tree nodes as the fullest draft
    of the batch holds: a plain decode step (1 node) when the drafter found nothing for any
    request. ``"device"`` drafts the linear drafter's chains on the device
    (:class:`~ngram_hal.speculative.lookup.DeviceDrafter`): the host never sees a draft, so every
    step runs the nodes the policy chose, and speculative steps overlap like plain ones.
    ``num_slots`` sizes the KV cache, handed out in pages of ``page_size`` slots (the last
    ``num_slots % page_size`` unused); ``max_running`` bounds the batch; ``max_context_len`` is
    the positions one request may use (prompt, output and ``3*D`` of speculation room), so D is
    at most :meth:`max_tree_size` of it.
    ``graphs`` replays decode and verify steps, and every prefill, from captured graphs
    where the backend's runtime can capture (:mod:`ngram_hal.engine.graphs`; never on the CPU or
    with a strict backend).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    tree_size: int = Field(8, ge=1)
    drafter: Literal["trie", "linear", "device"] = "trie"
    spec_policy: Literal["always", "auto"] = "always"
    probe_every: int = Field(16, ge=1)
    overlap: bool = True
    graphs: bool = True
    num_slots: int = Field(16384, ge=1)
    page_size: int = Field(1, ge=1)
    max_running: int = Field(32, ge=1)
    max_context_len: int = Field(2048, ge=8)
    max_prefill_tokens: int = Field(4096, ge=1)
    seed: int = 0

    @staticmethod
    def max_tree_size(max_context_len: int) -> int:
        """The largest D a context of ``max_context_len`` positions holds with room for one prompt
        token and one new token beside the ``3*D`` positions of speculation room."""
        return (max_context_len - 2) // 3

    @model_validator(mode="after")
    def _check_sizes(self) -> "EngineConfig":
        if self.page_size > self.num_slots:
            raise ValueError(f"page_size {self.page_size} exceeds num_slots {self.num_slots}: the cache holds no page")
        limit = self.max_tree_size(self.max_context_len)
        if self.tree_size > limit:
            raise ValueError(f"tree_size {self.tree_size} leaves no room in max_context_len {self.max_context_len} "
                             f"(a request keeps 3 * tree_size positions for draft trees): at most {limit}")
        return self
