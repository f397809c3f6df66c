"""A small, real engine: SmolLM2 over the HAL's paged KV cache with n-gram speculation and overlap."""

from .config import LlamaConfig
from .engine import Engine, EngineConfig
from .model import ForwardBatch, LlamaModel
from .request import RequestOutput, SamplingParams
from .tokenizer import Tokenizer

__all__ = ["Engine", "EngineConfig", "ForwardBatch", "LlamaConfig", "LlamaModel", "RequestOutput",
           "SamplingParams", "Tokenizer"]
