"""What every family's adapter shares: the segment's output, and the pieces every transformers causal LM has the
same way (its embedding, rotary embedding, final norm and LM head, dtypes). A family's adapter subclasses
CausalLMAdapter, sets `body` (the decoder stack), `lm_head` and `config`, and adds its layers' math.
"""

from dataclasses import dataclass, field

import torch


@dataclass
class SegmentOutput:
    hidden: torch.Tensor  # [1, T, C], before the final norm
    carry: dict = field(default_factory=dict)  # layer -> its carry after the segment (tuple of tensors)
    rows: dict = field(default_factory=dict)  # layer -> the segment's rows, token-major, in its spec's stream order
    attention: dict = field(default_factory=dict)  # layer -> (out, lse) of its attention (kept attention), if any


class CausalLMAdapter:
    body = lm_head = config = None  # set by the family's adapter

    @property
    def dtype(self):
        return self.body.embed_tokens.weight.dtype

    @property
    def device(self):
        return self.body.embed_tokens.weight.device

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

    def logprobs(self, hidden_1TC, targets):
        """log p(targets) from hidden states before the final norm (log-softmax in float32, float64 if float64)."""
        logits = self.lm_head(self.body.norm(hidden_1TC))[0]
        acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
        logp = torch.log_softmax(logits.to(acc), dim=-1)
        return logp.gather(-1, targets.to(logits.device).unsqueeze(-1)).squeeze(-1)
