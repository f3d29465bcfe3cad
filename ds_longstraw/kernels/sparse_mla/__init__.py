"""Sparse absorbed MLA (GLM's attention): each query attends over its selected latent rows only.

    attention.py         `sparse_latent_attention` (query blocks; backward recomputes, nothing [T, K, ...] saved),
                         its plain reference, one page's partial and gradients (context parallelism), and the
                         dispatch to Triton
    triton_attention.py  the same functions in Triton, rows read by index from the pieces (imports triton if
                         installed)
    selected_rows.py     the rows some query selected, laid out compactly for the backward, and their gradients
                         handed to the pieces or to a piece's row sink (the prompt pages' gradient pages)
"""

from .attention import (
    gather_rows,
    page_grads,
    page_partial,
    sparse_latent_attention,
    sparse_latent_attention_reference,
)

__all__ = [
    "sparse_latent_attention",
    "sparse_latent_attention_reference",
    "page_partial",
    "page_grads",
    "gather_rows",
]
