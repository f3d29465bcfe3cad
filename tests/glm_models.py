"""A tiny random transformers glm_moe_dsa (GLM-5.x shape) for tests, and the float64 reference settings it is checked
under.

The reference is transformers' own model. Two of its computations are not float64 in a float64 model and one is not
deterministic among ties, so `glm_reference()` changes exactly those, for the reference and the code under test alike:
  - its RMSNorm computes in float32: swapped for the same formula in max(float32, input) precision;
  - its DSA indexer scores in float32 (`.float()`): inside the indexer's forward `.float()` keeps float64;
  - its MoE router computes its logits in float32 (`.type(torch.float32)`): inside the router's forward that keeps
    float64. A float32 matmul rounds differently for different numbers of rows, so a chunked capture and a full
    forward would otherwise route with weights ~1e-8 apart;
  - its indexer's `topk` picks arbitrarily among tied scores (a prefill and a full forward disagree with few
    indexer heads, whose ReLU scores tie at exactly 0): inside the indexer's forward `topk` is the canonical one,
    score descending then position ascending (a stable descending sort), the order the adapter uses.
The patches live in a TorchFunctionMode entered around the indexer's own forward: the rest of the model (the
router's topk) is untouched, and nothing of ds_longstraw is put into transformers.
"""

from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa

VOCAB = 97


def tiny_glm_moe_dsa_config(**overrides):
    """hidden 64, 4 layers (indexer full, shared, full, shared), index_topk 8 (prompts of 40+ tokens make the
    selection sparse), 6 routed experts top-2 in 2 groups of 3 with one group per token (group-limited routing),
    one shared expert, a dense first layer. Sizes are small and distinct to catch layout bugs."""
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=40, kv_lora_rank=24, qk_nope_head_dim=12,
        qk_rope_head_dim=8, v_head_dim=10, index_head_dim=16, index_n_heads=3, index_topk=8, n_routed_experts=6,
        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
        indexer_types=["full", "shared", "full", "shared"], max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        experts_implementation="eager",  # the default grouped_mm refuses float64
    )
    kwargs.update(overrides)
    return GlmMoeDsaConfig(**kwargs)


def tiny_glm_moe_dsa(dtype=torch.float64, seed=0, **overrides):
    torch.manual_seed(seed)
    config = tiny_glm_moe_dsa_config(**overrides)
    config._attn_implementation = "sdpa"  # float64 softmax (eager attention casts scores to float32)
    model = GlmMoeDsaForCausalLM(config).to(dtype)
    # Random-init norms are all ones and the routing bias zeros; perturb everything a little so no path is trivially
    # identity, and give the router a non-zero correction bias (it changes which experts win, not their weights).
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.1)
    return model


def _rms_norm_forward(self, x):
    acc = torch.promote_types(x.dtype, torch.float32)
    h = x.to(acc)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * h.to(x.dtype)


def canonical_topk(scores, k, dim=-1, largest=True, sorted=True):
    """topk with ties broken by lower index first (score descending, then index ascending)."""
    assert largest, "the indexer asks for the largest scores"
    values, indices = torch.sort(scores, dim=dim, descending=True, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


class _RouterInFloat64(TorchFunctionMode):
    """Active only inside the router's forward: `.type(torch.float32)` keeps float64."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = (args[1] if len(args) > 1 else kwargs.get("dtype")) if func is torch.Tensor.type else None
        if target is torch.float32:
            return args[0].to(torch.promote_types(args[0].dtype, torch.float32))
        return func(*args, **kwargs)


class _IndexerInFloat64(TorchFunctionMode):
    """Active only inside the indexer's forward: `.float()` keeps float64, `.topk` is canonical_topk. `record`: a
    list that gets (layer, scores [B, S, N], indices [B, S, K]) of every selection."""

    def __init__(self, layer, record=None):
        super().__init__()
        self.layer, self.record = layer, record

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.float:
            return args[0].to(torch.promote_types(args[0].dtype, torch.float32))
        if func is torch.Tensor.topk:
            with torch._C.DisableTorchFunction():
                result = canonical_topk(*args, **kwargs)
            if self.record is not None:
                self.record.append((self.layer, args[0].detach().clone(), result.indices.clone()))
            return result
        return func(*args, **kwargs)


@contextmanager
def glm_reference(record=None):
    """transformers' glm_moe_dsa in float64 with the canonical top-k (module docstring). record: None, or a list
    that gets (layer, scores, indices) of each of the reference's indexer selections."""
    module = modeling_glm_moe_dsa
    norm, indexer, router = module.GlmMoeDsaRMSNorm.forward, module.GlmMoeDsaIndexer.forward, \
        module.GlmMoeDsaTopkRouter.forward

    def indexer_forward(self, *args, **kwargs):
        with _IndexerInFloat64(self.layer_idx, record):
            return indexer(self, *args, **kwargs)

    def router_forward(self, *args, **kwargs):
        with _RouterInFloat64():
            return router(self, *args, **kwargs)

    module.GlmMoeDsaRMSNorm.forward = _rms_norm_forward
    module.GlmMoeDsaIndexer.forward = indexer_forward
    module.GlmMoeDsaTopkRouter.forward = router_forward
    try:
        yield
    finally:
        module.GlmMoeDsaRMSNorm.forward, module.GlmMoeDsaIndexer.forward = norm, indexer
        module.GlmMoeDsaTopkRouter.forward = router


def reference_selections(record):
    """{(layer, position): the set of positions the reference selected} from glm_reference's record."""
    sets = {}
    for layer, scores, indices in record:
        scores, indices = scores[0], indices[0].long()
        for t in range(scores.shape[0]):
            chosen = indices[t]
            sets[(layer, t)] = set(chosen[scores[t, chosen] > float("-inf")].tolist())
    return sets


def boundary_ties(record):
    """Queries whose K-th and (K+1)-th best scores are equal (the tie-break decides the selected set)."""
    ties = 0
    for _, scores, indices in record:
        k = indices.shape[-1]
        values = torch.sort(scores[0], dim=-1, descending=True, stable=True).values
        ties += int(((values[:, k - 1] == values[:, k]) & (values[:, k] > float("-inf"))).sum())
    return ties
