"""What every family's adapter shares: the segment's output, and the pieces every transformers causal LM has the
same way (its embedding, rotary embedding, final norm and LM head, dtypes). A family's adapter subclasses
CausalLMAdapter, sets `body` (the decoder stack), `lm_head` and `config`, and adds its layers' math.
"""

from dataclasses import dataclass, field

import torch

from ds_longstraw.kernels import VOCAB_CHUNK, chunked_logprobs, chunked_logprobs_entropy
from ds_longstraw.kernels.dispatch import record


@dataclass
class SegmentOutput:
    hidden: torch.Tensor  # [1, T, C], before the final norm
    carry: dict = field(default_factory=dict)  # layer -> its carry after the segment (tuple of tensors)
    rows: dict = field(default_factory=dict)  # layer -> the segment's rows, token-major, in its spec's stream order
    attention: dict = field(default_factory=dict)  # layer -> (out, lse) of its attention (kept attention), if any


def inject_gradients(outputs, grads, backward=None):
    """Back-propagate `grads` into `outputs` (None: zeros). Every output that requires grad is a root, whatever its
    gradient, so that a real iteration and a zero one (ZeRO-3 lockstep) walk the same modules backward.
    backward: None (torch.autograd.backward), or a callable taking one scalar (DeepSpeed's engine.backward): it
    gets sum((output * grad).sum()), whose gradient with respect to each output is exactly its grad."""
    live = [(o, torch.zeros_like(o) if g is None else g.to(o.dtype))
            for o, g in zip(outputs, grads, strict=True) if o is not None and o.requires_grad]
    if not live:
        return
    if backward is None:
        torch.autograd.backward([o for o, _ in live], [g for _, g in live])
    else:
        backward(sum((o * g.detach()).sum() for o, g in live))


def grad_leaf(tensor):
    """A detached copy of `tensor` that requires grad (None stays None): where a piece-by-piece backward cuts the
    graph and reads the gradient back (grad_of)."""
    return None if tensor is None else tensor.detach().requires_grad_(True)


def grad_of(leaf):
    """The gradient a grad_leaf got (zeros where backward reached none; None for None)."""
    if leaf is None:
        return None
    return torch.zeros_like(leaf) if leaf.grad is None else leaf.grad


class CausalLMAdapter:
    body = lm_head = config = None  # set by the family's adapter

    @property
    def dtype(self):
        return self.body.embed_tokens.weight.dtype

    @property
    def device(self):
        return self.body.embed_tokens.weight.device

    @property
    def hidden_size(self):
        return self.config.hidden_size

    @property
    def vocab_size(self):
        return self.config.vocab_size

    def state_dtype(self):
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    def embed(self, ids):
        return self.body.embed_tokens(ids.to(self.device).unsqueeze(0))

    def rotary(self, hidden, start):
        positions = torch.arange(start, start + hidden.shape[1], device=hidden.device).unsqueeze(0)
        return self.body.rotary_emb(hidden, positions)

    # Vocabulary ids per chunk of the log-probs (ds_longstraw.kernels.chunked_logprobs); None or 0: the plain path,
    # full [T, V] logits then log_softmax. A class attribute, so a test or a user can force the reference with
    # `CausalLMAdapter.logprobs_vocab_chunk = None` (adapters are made per call).
    logprobs_vocab_chunk = VOCAB_CHUNK
    # The temperature the log-probs are scored at (softmax of logits / temperature): the transaction sets it on its
    # adapter from the objective's `temperature` (TRL's), so that every log-prob it takes (replay, reference, a
    # member's steps) is at the sampling temperature. 1: the model's own distribution.
    logprobs_temperature = 1.0

    def logprobs(self, hidden_1TC, targets, with_entropy=False):
        """log p(targets) from hidden states before the final norm (log-softmax in float32, float64 if float64) at
        `logprobs_temperature`; with_entropy: (log p(targets), the softmax's entropy at each token), for an entropy
        bonus.

        With a plain nn.Linear LM head the vocabulary is walked in chunks (forward and backward), so no [T, V]
        logits exist: at Qwen3.6's 248,320-token vocabulary those are about 1 GB per 1,024 tokens in float32, and
        the plain path holds several copies (logits, log-softmax, its gradient). Any other head (a peft LoRA
        wrapper, a quantized linear) takes the plain path through the module call: the chunked path reads only a
        plain head's weight and bias. Both paths run inside the head's module call (head_logprobs), so ZeRO-3
        gathers a partitioned head as before.
        """
        normed_1TC = self.body.norm(hidden_1TC)
        if not self.logprobs_vocab_chunk or type(self.lm_head) is not torch.nn.Linear:
            record("log-probs", "full_logits")
            logits = self.lm_head(normed_1TC)[0]
            acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
            logp_TV = torch.log_softmax(logits.to(acc) / self.logprobs_temperature, dim=-1)
            logp = logp_TV.gather(-1, targets.to(logits.device).unsqueeze(-1)).squeeze(-1)
            return (logp, -(logp_TV.exp() * logp_TV).sum(dim=-1)) if with_entropy else logp
        return head_logprobs(self.lm_head, normed_1TC[0], targets, self.logprobs_vocab_chunk, with_entropy,
                             self.logprobs_temperature)


def head_logprobs(head, hidden_TC, targets_T, vocab_chunk, with_entropy=False, temperature=1.0):
    """chunked_logprobs through a plain nn.Linear head, run AS the head's module call: the call's hooks are what
    ZeRO-3 gathers a partitioned weight in (pre-forward) and gathers it again in backward (a hook on the call's
    output, before this backward reads the saved weight), releasing it after the gradient has been accumulated (a
    hook on the call's input). Reading head.weight outside a call would see an empty partition. Without ZeRO-3
    the call is a plain function call. Each block makes one call, as the plain path does, so ZeRO-3's call order
    matches on every rank."""

    kernel = chunked_logprobs_entropy if with_entropy else chunked_logprobs

    def chunked_forward(hidden_TC, targets_T):
        return kernel(hidden_TC, head.weight, targets_T, head.bias, vocab_chunk, temperature)

    head.forward = chunked_forward  # an instance attribute: nn.Module.__call__ runs it between the hooks
    try:
        return head(hidden_TC, targets_T)
    finally:
        del head.forward
