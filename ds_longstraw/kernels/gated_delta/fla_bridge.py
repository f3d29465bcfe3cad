"""The gated delta rule on CUDA through flash-linear-attention's chunk kernel (the `fla-core` package).

Same signature and results (up to rounding) as the project's `chunked.chunk_gated_delta_rule`, which
`chunk_gated_delta_rule` there hands over to this one where `fla_applies` holds: mode "auto", CUDA tensors, fla
importable, a dtype fla computes in (not float64: float64 checks stay on the project's kernel), head dims it tiles.
fla takes the initial state and returns the final state in float32, and its backward returns the initial state's
gradient: exactly what the transaction's carry needs (a prompt's chunks chain their states through it).
Legend as reference.py: q, k [B, T, Hk, dk]; v [B, T, Hv, dv]; g (log decay) and beta [B, T, Hv];
state [B, Hv, dk, dv].
"""

import torch

from ..dispatch import fast_path
from .fla_dqkwg import dqkwg_refused, ensure_registered

# fla tiles the key and value head dims in blocks of at most 256 (Qwen3.6: 128 each).
_MAX_HEAD_DIM = 256


def fla_backward_works(device) -> bool:
    """Whether fla's backward runs on `device`. fla 0.6 refuses it (a RuntimeError at the first backward) with
    Triton >= 3.4 and < 3.7.1 on Hopper (H20, H100, H200), whose compiler builds one of its kernels wrongly; there
    the project's torch build of that one step (fla_dqkwg.py) is registered with fla and serves it, unless fla's
    backend dispatch is turned off."""
    return not dqkwg_refused(device) or ensure_registered()


def fla_applies(query, value, initial_state=None) -> bool:
    if not fast_path(query, "fla"):
        return False
    needs_backward = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (query, value, initial_state))
    if needs_backward and not fla_backward_works(query.device):
        return False  # the project's kernel computes this call (its backward is right on every device)
    if query.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    if query.shape[-1] > _MAX_HEAD_DIM or value.shape[-1] > _MAX_HEAD_DIM:
        return False
    return initial_state is None or initial_state.device == query.device


def chunk_gated_delta_rule_fla(query, key, value, g, beta, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_rule

    fla_backward_works(query.device)  # registers the torch dqkwg step where fla refuses its own, before any backward
    state = None if initial_state is None else initial_state.to(torch.float32)
    out, final = fla_rule(query, key, value, g=g.to(torch.float32), beta=beta, scale=query.shape[-1] ** -0.5,
                          initial_state=state, output_final_state=output_final_state,
                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    if final is not None and initial_state is not None:
        final = final.to(initial_state.dtype)
    return out.to(query.dtype), final
