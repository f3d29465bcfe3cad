"""The single-process reference the equivalence tests hold the transaction against, written once.

One group, one process, ordinary autograd: every member's log-probs from `logprob_fn` (full-sequence autograd of
the transformers model for exact mode; its cache continuation from the captured prompt for detached mode), the
reference model's without a graph, the GRPO loss back-propagated once.
"""

import torch
from grads import grads_of


def reference_step(model, group, loss_fn, logprob_fn, ref_model=None):
    """(gradients by parameter name, (loss, log-probs, reference log-probs or None)) of `group`:
    loss_fn(group, logps, ref_logps) back-propagated from logprob_fn(model, prompt_ids, response_ids); the
    reference log-probs are ref_model's (no graph), None without one."""

    def run():
        logps = logprob_fn(model, group.prompt_ids, group.response_ids)
        ref = None
        if ref_model is not None:
            with torch.no_grad():
                ref = [lp.detach() for lp in logprob_fn(ref_model, group.prompt_ids, group.response_ids)]
        loss = loss_fn(group, logps, ref)
        loss.backward()
        return float(loss.detach()), [lp.detach() for lp in logps], ref

    return grads_of(model, run)
