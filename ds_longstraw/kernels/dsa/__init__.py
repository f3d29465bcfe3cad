"""DSA selection (DeepSeek Sparse Attention's indexer, GLM's): each query's canonical top-k of the keys it sees.

    selection.py         `dsa_select` and the candidate sets of context parallelism in torch (block by block), the
                         plain reference `dsa_select_reference`, and the dispatch to the Triton scores
    triton_selection.py  the indexer's scores in Triton, then the same canonical top-k (imports triton if installed)
"""

from .selection import (
    KEY_BLOCK,
    candidates_selection,
    dsa_select,
    dsa_select_reference,
    extend_candidates,
    merge_candidate_sets,
    merge_candidates,
    no_candidates,
    score_dtype,
)

__all__ = [
    "dsa_select",
    "dsa_select_reference",
    "extend_candidates",
    "merge_candidates",
    "merge_candidate_sets",
    "no_candidates",
    "candidates_selection",
    "score_dtype",
    "KEY_BLOCK",
]
