"""``LlamaConfig``: the shape of a Llama-family model."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class LlamaConfig(BaseModel):
    """Hyper-parameters of a Llama-family decoder (read from a GGUF file or given for tests).

    ``num_heads`` query heads share ``num_kv_heads`` key/value heads (grouped-query attention);
    ``head_dim`` is the width of one head.
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
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    @model_validator(mode="after")
    def _check_shapes(self) -> "LlamaConfig":
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"{name} ({value}) outside the vocabulary [0, {self.vocab_size})")
        return self
