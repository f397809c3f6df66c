"""Backend-neutral speculative-decoding core: n-gram corpus, drafters, verify glue, overlap relay."""

from .corpus import Corpus
from .drafter import DraftBatch, Drafter, LinearDrafter, TrieDrafter
from .relay import OverlapRelay
from .verify import (TreeBatch, VerifyOutput, commit, prepare_tree, slots_needed, tree_cache_locs,
                     verify_greedy, verify_sample)

__all__ = ["Corpus", "DraftBatch", "Drafter", "LinearDrafter", "OverlapRelay", "TreeBatch", "TrieDrafter",
           "VerifyOutput", "commit", "prepare_tree", "slots_needed", "tree_cache_locs", "verify_greedy",
           "verify_sample"]
