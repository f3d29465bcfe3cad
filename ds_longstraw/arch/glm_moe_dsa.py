"""transformers' glm_moe_dsa (GLM-5.x): what its layers retain, from a config alone.

Per layer, MLA keeps the normalised latent c_kv [kv_lora_rank] and the roped shared key k_rope [qk_rope_head_dim]
per token; a "full" DSA indexer layer also keeps its indexer key [index_head_dim] per token, which no loss path
reaches (the model runs the indexer under no_grad), so it has no gradient pages; a "shared" indexer layer reuses
the selection of the last full layer and keeps nothing more. MoE and MLP blocks retain nothing.

Only the specs are here so far: `longstraw plan` sizes GLM-5.2 from them. The transaction's adapter for this family
(absorbed MLA over selected rows, the global top-k) is the work of the GLM-5.2 issue.
"""

from .specs import LayerState, Stream

FULL_INDEXER, SHARED_INDEXER = "full", "shared"


def state_specs(config, dtype) -> list:
    layers = config.num_hidden_layers
    indexer = list(getattr(config, "indexer_types", None) or [FULL_INDEXER] * layers)[:layers]
    unknown = set(indexer) - {FULL_INDEXER, SHARED_INDEXER}
    if unknown:
        raise ValueError(f"glm_moe_dsa: unknown indexer types {sorted(unknown)}")
    latent = Stream("latent", (config.kv_lora_rank,), dtype)
    rope_key = Stream("rope_key", (config.qk_rope_head_dim,), dtype)
    index_key = Stream("index_key", (config.index_head_dim,), dtype, grad=False, label="indexer_key_pages")
    specs = []
    for index, kind in enumerate(indexer):
        streams = (latent, rope_key, index_key) if kind == FULL_INDEXER else (latent, rope_key)
        specs.append(LayerState(index, f"mla_{kind}_indexer", "mla_latent_pages", streams=streams, combine="lse"))
    return specs
