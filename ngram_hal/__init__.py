"""ngram-hal: n-gram speculative decoding with overlap scheduling on any accelerator."""

from .backend import OPS, Backend, Capabilities
from .contract import INDEX_DTYPE, SENTINEL, ContractError
from .layout import AttentionLayout
from .registry import get_backend, list_backends

__all__ = ["OPS", "AttentionLayout", "Backend", "Capabilities", "ContractError", "INDEX_DTYPE", "SENTINEL",
           "get_backend", "list_backends"]
__version__ = "0.1.0"
