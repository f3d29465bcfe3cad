"""Adapter for transformers' glm_moe_dsa (GLM-5.x): MLA with DSA sparse attention, IndexShare, MoE.

What a layer retains (from a config alone, `state_specs`): MLA keeps the normalised latent c_kv [kv_lora_rank] and
the roped shared key k_rope [qk_rope_head_dim] per token; a "full" DSA indexer layer also keeps its indexer key
[index_head_dim] per token, which no loss path reaches (the model runs the indexer under no_grad), so it has no
gradient pages; a "shared" indexer layer reuses the selection of the last full layer and keeps nothing more. MoE and
MLP blocks retain nothing. Nothing per head is materialised for the prompt, in any phase.

How a segment runs (`GlmMoeDsaAdapter.forward_segment`): per layer the indexer scores every earlier position from
the indexer keys and keeps a canonical top-k (kernels/dsa: dsa_select, score descending, then position
ascending); absorbed MLA attends over the selected latent rows only (sparse_latent_attention), which equals the
model's expanded attention over its index mask; the decoder layer's own `mlp` (router and experts, or the dense
MLP) follows.

Under context parallelism (ds_longstraw.parallel, the "topk_lse" combine) the same layer runs with the earlier keys
on other ranks: forward_segment's `remote_attention` gives their candidates (merged into the global canonical
top-k) and the partial of the selected rows among them (merged by log-sum-exp); the layer-major capture asks for
the layer's pieces (sparse_project, sparse_candidates, merge_candidates, sparse_selection, sparse_partial,
sparse_grads, attention_finish). The selection is the same as on one rank, ties included.

Legend: T tokens of the segment, C hidden size, H heads, R kv_lora_rank, E qk_rope_head_dim, n qk_nope_head_dim,
v v_head_dim, I / D indexer heads / head dim. Rows are token-major: latent [T, R], rope key [T, E], indexer key
[T, D].
"""

import torch
import torch.utils.checkpoint
from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave

from ds_longstraw.kernels import dsa, merge_partials, sparse_mla
from ds_longstraw.kernels.dsa import score_dtype

from .base import CausalLMAdapter, SegmentOutput
from .decode import OwnBatch
from .family import Family
from .glm_moe_dsa_experts import (
    expert_parallel,
    moe_forward,
    shard_experts,
    unregister_slices,
)
from .specs import LayerState, SparseGeometry, Stream, carry_layers, paged_layers

FULL_INDEXER, SHARED_INDEXER = "full", "shared"
LATENT, ROPE_KEY, INDEX_KEY = "latent", "rope_key", "index_key"  # the streams of a layer's pages
SELECTION = "selection"  # a full indexer layer's kept stream (exact mode's prefix_keep_attention)
# Linear layers that LoRA adapters attach to by default: the MLA projections, the dense MLP and the shared
# expert's projections. Not the indexer (it gets no gradient), the router, or the routed experts (3-D parameters,
# not Linear modules).
LORA_TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
                "down_proj"]


def encode_selection(positions, valid):
    """A selection (positions [T, K] int64, valid [T, K]) as int32 codes [T, K]: the position, -1 where invalid
    (positions stay below 2^31: prompts are far shorter)."""
    return torch.where(valid, positions, -1).to(torch.int32)


def decode_selection(code):
    """encode_selection's inverse: (positions [T, K] int64, 0 where invalid as dsa_select leaves them; valid)."""
    valid = code >= 0
    return code.clamp(min=0).long(), valid


def kept_selection(code, topk):
    """A segment's selection codes [T, K] as the kept pages hold them: [topk, T] (the kept streams' convention is
    per-token values on the first axis, as attention heads are, grpo/state.py), -1 past K (K = min(topk, the
    segment's end): its first tokens see fewer than topk keys)."""
    return torch.nn.functional.pad(code, (0, topk - code.shape[1]), value=-1).t()


def known_selection(kept, start, tokens, topk):
    """kept_selection's inverse for the segment of `tokens` tokens at positions start..: its codes [T, K], cut to
    the K = min(topk, start + tokens) columns dsa_select returns there, token-major in memory (a transposed view
    would hand the attention column-major positions, whose gathers ran the prefix pass's backward 20% slower)."""
    return kept.t()[:, :min(topk, start + tokens)].contiguous()


def zero3_leaf_modules(model) -> list:
    """Module classes ZeRO-3 should gather whole (deepspeed.utils.set_z3_leaf_modules): the MoE block (router,
    fused experts, shared expert) is gathered once per call instead of hooking inside it, where the routed experts
    a call uses depend on the tokens (hooks that fire for some experts and not others desynchronise the ranks'
    gathers)."""
    return sorted({type(layer.mlp) for layer in _decoder_layers(model) if hasattr(layer.mlp, "gate")},
                  key=lambda cls: cls.__name__)


def _decoder_layers(model):
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    return lm.model.layers


def indexer_types(config) -> list:
    """Per layer "full" (runs its indexer) or "shared" (reuses the last full layer's selection)."""
    layers = config.num_hidden_layers
    kinds = list(getattr(config, "indexer_types", None) or [FULL_INDEXER] * layers)[:layers]
    unknown = set(kinds) - {FULL_INDEXER, SHARED_INDEXER}
    if unknown:
        raise ValueError(f"glm_moe_dsa: unknown indexer types {sorted(unknown)}")
    return kinds


def state_specs(config, dtype) -> list:
    """Every layer combines by "topk_lse": a full indexer layer selects with its indexer keys, a shared one reuses
    the last full layer's selection (its spec selects nothing)."""
    latent = Stream(LATENT, (config.kv_lora_rank,), dtype)
    rope_key = Stream(ROPE_KEY, (config.qk_rope_head_dim,), dtype)
    index_key = Stream(INDEX_KEY, (config.index_head_dim,), dtype, grad=False, label="indexer_key_pages")
    # exact mode's prefix_keep_attention keeps what makes this family's attention cost more than linear: a full
    # indexer layer's selection (the scores over every earlier key and their top-k), as int32 codes
    selection = Stream(SELECTION, (config.index_topk,), torch.int32, grad=False)
    specs = []
    for index, kind in enumerate(indexer_types(config)):
        full = kind == FULL_INDEXER
        specs.append(LayerState(index, f"mla_{kind}_indexer", "mla_latent_pages",
                                streams=(latent, rope_key, index_key) if full else (latent, rope_key),
                                combine="topk_lse", select=(INDEX_KEY,) if full else (),
                                kept=(selection,) if full else ()))
    return specs


def kernel_dims(config) -> dict:
    """What the planner's kernel workspaces and CP time model scale with (arch.kernel_dims): absorbed MLA's query
    head reads the latent and the rope key; the selection keeps index_topk rows and scores with the indexer's
    heads."""
    return {"vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
            "attention_heads": config.num_attention_heads,
            "attention_head_dim": config.kv_lora_rank + config.qk_rope_head_dim,
            "select_topk": config.index_topk, "index_width": config.index_n_heads * config.index_head_dim}


def expert_shape(config) -> dict:
    """The routed experts as the planner sizes them (offload/plan.MoEShape's fields), from a config alone: experts
    per MoE layer, top-k, hidden size, MoE layers ("sparse" in mlp_layer_types, which transformers derives from
    first_k_dense_replace), and per MoE layer the routed experts' parameters and the whole block's (router, routed
    and shared experts: what ZeRO-3 gathers per call of the block as a leaf module). The counts come from one block
    built on the meta device, so they follow the module's own parameters."""
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaMoE

    kinds = getattr(config, "mlp_layer_types", None) or (
        ["dense"] * min(config.first_k_dense_replace, config.num_hidden_layers)
        + ["sparse"] * max(config.num_hidden_layers - config.first_k_dense_replace, 0))
    with torch.device("meta"):
        block = GlmMoeDsaMoE(config)
    return {"experts": config.n_routed_experts, "experts_per_token": config.num_experts_per_tok,
            "hidden_size": config.hidden_size, "layers": sum(kind == "sparse" for kind in kinds),
            "routed_params": sum(p.numel() for p in block.experts.parameters()),
            "block_params": sum(p.numel() for p in block.parameters())}


class GlmMoeDsaAdapter(CausalLMAdapter):
    """Runs segments of a transformers glm_moe_dsa causal LM (GlmMoeDsaForCausalLM, or a peft wrapper of one) by
    calling its own submodules.

    Weights: every parameter is read by calling the module that owns it (ZeRO-3 gathers a module's parameters in
    its pre-forward hook), kv_b_proj included: its weight enters the absorbed attention as kv_b_proj(identity)
    (see `absorbed_maps`), which is also what makes a LoRA adapter on kv_b_proj count. The router and the experts
    run as the layer's own `mlp` module. Under context parallelism the prompt's keys on other ranks are reached
    through `remote_attention` (forward_segment) and the layer-major capture runs a layer in pieces
    (sparse_project, sparse_candidates, sparse_partial, sparse_grads, attention_finish: ds_longstraw.parallel's
    "topk_lse" combine). No kept attention (known_attention). With the routed experts sharded (shard_experts), a MoE
    block's pairs go to their owners (glm_moe_dsa_experts.py).
    """

    family = "glm_moe_dsa"

    def __init__(self, model):
        self.model = model
        lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.lm_head = lm.lm_head
        self.body = lm.model
        self.config = self.body.config
        self.layers = self.body.layers
        self.specs = state_specs(self.config, self.dtype)
        self.indexer_types = indexer_types(self.config)
        if self.indexer_types and self.indexer_types[0] != FULL_INDEXER:
            raise ValueError("glm_moe_dsa: the first layer must run its own indexer (indexer_types[0] = 'full'): "
                             "a shared layer reuses the selection of an earlier full layer")
        self.paged_layers = paged_layers(self.specs)  # every layer: latent + rope key (+ indexer key)
        self.carry_layers = carry_layers(self.specs)  # none

    # -- pieces ------------------------------------------------------------------------------------------

    def mla_projections(self, module, h_1TC, cos, sin):
        """q_nope [T, H, n], q_rope [T, H, E] (roped), q_resid [1, T, q_lora_rank] (what the indexer's query reads),
        the latent c_kv [T, R] (after kv_a_layernorm) and the roped shared key k_rope [T, E]: as the model's
        attention computes them, without expanding anything per head."""
        t = h_1TC.shape[1]
        q_resid = module.q_a_layernorm(module.q_a_proj(h_1TC))
        query = module.q_b_proj(q_resid).view(1, t, -1, module.qk_head_dim).transpose(1, 2)
        q_nope, q_rope = torch.split(query, [module.qk_nope_head_dim, module.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.mla_rows(module, h_1TC, cos, sin)
        q_rope = _roped(q_rope, cos, sin)
        return q_nope[0].transpose(0, 1), q_rope[0].transpose(0, 1), q_resid, latent, k_rope

    def mla_rows(self, module, h_1TC, cos, sin):
        """The latent c_kv [T, R] (after kv_a_layernorm) and the roped shared key k_rope [T, E]: the rows a layer
        pages, all that later tokens read of its attention."""
        t = h_1TC.shape[1]
        latent, k_rope = torch.split(module.kv_a_proj_with_mqa(h_1TC), [module.kv_lora_rank, module.qk_rope_head_dim],
                                     dim=-1)
        latent = module.kv_a_layernorm(latent)
        return latent[0], _roped(k_rope.view(1, 1, t, -1), cos, sin)[0, 0]

    def indexer_inputs(self, indexer, h_1TC, q_resid, cos, sin):
        """The DSA indexer's query [T, I, D], per-head weights [T, I] (times I^-0.5) and key [T, D] (the key
        [rope | pass], roped interleaved, as the model's indexer builds them); no gradient, as the model defines."""
        t = h_1TC.shape[1]
        rope = indexer.qk_rope_head_dim
        with torch.no_grad():
            query = indexer.wq_b(q_resid).view(1, t, indexer.n_heads, indexer.head_dim)
            q_rot, q_pass = torch.split(query, [rope, indexer.head_dim - rope], dim=-1)
            query = torch.cat([_roped(q_rot, cos, sin, unsqueeze_dim=2), q_pass], dim=-1)[0]
            key = self.indexer_key(indexer, h_1TC, cos, sin)
            weights_proj = indexer.weights_proj
            weights = weights_proj(h_1TC.to(weights_proj.weight.dtype))[0]
            weights = weights.to(score_dtype(query.dtype)) * indexer.n_heads ** -0.5
        return query, weights, key

    def indexer_key(self, indexer, h_1TC, cos, sin):
        """The DSA indexer's key [T, D] ([rope | pass], roped interleaved, as the model's indexer builds it): a full
        indexer layer's third row; no gradient, as the model defines."""
        rope = indexer.qk_rope_head_dim
        with torch.no_grad():
            key = indexer.k_norm(indexer.wk(h_1TC)).unsqueeze(2)
            k_rot, k_pass = torch.split(key, [rope, indexer.head_dim - rope], dim=-1)
            return torch.cat([_roped(k_rot, cos, sin, unsqueeze_dim=2), k_pass], dim=-1)[0, :, 0]

    def absorbed_maps(self, module):
        """W_UK [R, H, n] and W_UV [R, H, v] of kv_b_proj, read by calling the module on the identity: the output
        row i is the map of the latent's unit vector e_i, so ZeRO-3's hook gathers the weight for the call, a LoRA
        adapter's delta is included, and autograd takes the weight's gradient through it."""
        proj = module.kv_b_proj
        if getattr(proj, "bias", None) is not None:
            raise ValueError("glm_moe_dsa adapter: kv_b_proj with a bias is not supported (the model has none)")
        eye = torch.eye(module.kv_lora_rank, dtype=self.dtype, device=self.device)
        maps = proj(eye).view(module.kv_lora_rank, -1, module.qk_nope_head_dim + module.v_head_dim)
        return torch.split(maps, [module.qk_nope_head_dim, module.v_head_dim], dim=-1)

    def attention_forward(self, index, module, h_1TC, cos, sin, start, past, selection, remote=None, selected=None):
        """One MLA + DSA attention: (output [1, T, C], the segment's rows, the selection (positions, valid) this
        layer used). past: the row tuples before the segment, in position order up to start-1; selection: the
        last full indexer layer's, for a shared layer; selected: None, or a full indexer layer's own selection
        made before from the same inputs (the prefix pass's recompute of the layer in backward), used instead of
        selecting again.

        remote: None (the past starts at position 0), or (context parallelism) the keys before the past, on other
        ranks: remote.end is where they end (the past covers remote.end .. start-1); remote.candidates(index,
        selector) -> their canonical candidates for this layer's selection (scores, positions); remote.attend(index,
        query, positions, valid) -> the (o_lat, lse) partial of the selected rows among them, differentiable in the
        query. The selection is then global (their candidates merged with the past's and the segment's keys) and
        the local and remote partials merge by log-sum-exp."""
        q_nope, q_rope, q_resid, latent, k_rope = self.mla_projections(module, h_1TC, cos, sin)
        offset = _past_start(index, past, start, remote)
        rows = (latent, k_rope)
        if module.indexer is not None:
            query, weights, key = self.indexer_inputs(module.indexer, h_1TC, q_resid, cos, sin)
            if selected is not None:
                selection = selected
            else:
                keys = [piece[2] for piece in past] + [key]
                prior = None if remote is None else remote.candidates(index, (query, weights))
                selection = dsa.dsa_select(query, weights, keys, start, module.indexer.index_topk,
                                           module.indexer.softmax_scale, offset=offset, prior=prior)
            rows = (latent, k_rope, key)
        elif selection is None:
            raise ValueError(f"glm_moe_dsa layer {index}: a shared indexer layer needs an earlier full layer's "
                             "selection")
        w_uk, w_uv = self.absorbed_maps(module)
        q_lat = torch.einsum("thn,rhn->thr", q_nope, w_uk)
        latents = [piece[0] for piece in past] + [latent]
        ropes = [piece[1] for piece in past] + [k_rope]
        # staged prompt pages in exact mode (offload.PagesPair) take their selected rows' gradients themselves
        sinks = [getattr(piece, "row_sink", None) for piece in past] + [None]
        if remote is None:
            o_lat = sparse_mla.sparse_latent_attention(q_lat, q_rope, latents, ropes, *selection, module.scaling,
                                                       row_sinks=sinks)
        else:
            o_lat, lse = sparse_mla.sparse_latent_attention(q_lat, q_rope, latents, ropes, *selection, module.scaling,
                                                            offset=offset, with_lse=True, row_sinks=sinks)
            remote_out, remote_lse = remote.attend(index, (q_lat, q_rope), *selection)
            o_lat, _ = merge_partials(o_lat, lse, remote_out, remote_lse.to(lse.dtype))
        out = torch.einsum("thr,rhv->thv", o_lat, w_uv).reshape(1, h_1TC.shape[1], -1)
        return module.o_proj(out), rows, selection

    def mlp_residual(self, index, hidden_1TC):
        """hidden + mlp(post_attention_layernorm(hidden)) of layer `index` (a dense MLP, or the MoE block: the
        model's router and experts, called as the module; with its experts sharded over an EP group
        (shard_experts), the block's forward with the routed pairs dispatched to their owners)."""
        layer = self.layers[index]
        normed = layer.post_attention_layernorm(hidden_1TC)
        if getattr(getattr(layer.mlp, "experts", None), "expert_parallel", None) is not None:
            return hidden_1TC + moe_forward(layer.mlp, normed)
        return hidden_1TC + layer.mlp(normed)

    # -- one layer, piece by piece: the "topk_lse" combine under context parallelism (ds_longstraw.parallel) -----
    # A layer is hidden + attention(input_norm(hidden)), then + mlp(post_norm(hidden)). The layer-major capture runs
    # the attention over a whole shard and the replay / prefix pass reach other ranks' rows, so the generic code
    # asks for the pieces: the projections (what the selection and the attention send to the rows' owners, what
    # the output needs), one page's candidates, one page's partial and its gradients, and the output.
    def mixer_input(self, index, hidden_1TC):
        return self.layers[index].input_layernorm(hidden_1TC)

    def sparse_geometry(self, index):
        """What layer `index`'s exchanges carry per query token (specs.SparseGeometry): the selector (indexer query
        [I, D] and head weights [I]), the query (q_lat [H, R] and q_rope [H, E]), a partial's o_lat [H, R]."""
        config, dtype = self.config, self.dtype
        heads = config.num_attention_heads
        score = score_dtype(dtype)
        return SparseGeometry(
            selector=(((config.index_n_heads, config.index_head_dim), dtype), ((config.index_n_heads,), score)),
            query=(((heads, config.kv_lora_rank), dtype), ((heads, config.qk_rope_head_dim), dtype)),
            out=((heads, config.kv_lora_rank), dtype), lse_dtype=self.state_dtype(), score_dtype=score,
            topk=config.index_topk)

    def sparse_project(self, index, h_1TC, start):
        """(selector or None, query, what attention_finish needs, rows) of tokens at positions start.. of layer
        `index`: the selector (indexer query [T, I, D], weights [T, I]) on a full indexer layer, None on a shared
        one; the query (q_lat [T, H, R], roped q_rope [T, H, E]); W_UV; the rows in the order of the layer's
        streams (latent, rope key[, indexer key])."""
        module = self.layers[index].self_attn
        cos, sin = self.rotary(h_1TC, start)
        q_nope, q_rope, q_resid, latent, k_rope = self.mla_projections(module, h_1TC, cos, sin)
        w_uk, w_uv = self.absorbed_maps(module)
        query = (torch.einsum("thn,rhn->thr", q_nope, w_uk), q_rope)
        if module.indexer is None:
            return None, query, w_uv, (latent, k_rope)
        index_query, weights, key = self.indexer_inputs(module.indexer, h_1TC, q_resid, cos, sin)
        return (index_query, weights), query, w_uv, (latent, k_rope, key)

    def attention_finish(self, index, o_lat, w_uv):
        """The layer's mixer output [1, T, C] from the attention result o_lat [T, H, R] (W_UV, then o_proj)."""
        out = torch.einsum("thr,rhv->thv", o_lat, w_uv).reshape(1, o_lat.shape[0], -1)
        return self.layers[index].self_attn.o_proj(out)

    def sparse_candidates(self, index, selector, pages, page_start, query_start=None, best=None):
        """`best` (None, or canonical candidates of keys below page_start) extended by one page of indexer keys
        (pages[INDEX_KEY], positions page_start ..) for queries at positions query_start .. (None: after every key
        of the page); returns (scores, positions), at most index_topk per query."""
        indexer = self.layers[index].self_attn.indexer
        query, weights = selector
        return dsa.extend_candidates(best, query, weights, pages[INDEX_KEY], page_start, query_start,
                                     indexer.index_topk, indexer.softmax_scale)

    def merge_candidates(self, best, part, interleaved=False):
        """Canonical candidates of best (None: none) and `part`, whose positions all lie above best's, or with
        `interleaved` anywhere else (another rank's pieces of a zigzag layout)."""
        if best is None:
            best = dsa.no_candidates(part[0].shape[0], part[0].dtype, part[0].device)
        merge = dsa.merge_candidate_sets if interleaved else dsa.merge_candidates
        return merge(best, part, self.config.index_topk)

    def sparse_selection(self, index, best, start, tokens):
        """The selection (positions, valid) [T, min(topk, start + T)] of queries at positions start .. from their
        final canonical candidates (None: none)."""
        if best is None:
            best = dsa.no_candidates(tokens, score_dtype(self.dtype), self.device)
        return dsa.candidates_selection(best, min(self.config.index_topk, start + tokens))

    def sparse_partial(self, index, query, pages, page_start, positions, valid):
        """(o_lat, lse) of the query over its selected rows within one page (positions page_start ..)."""
        module = self.layers[index].self_attn
        return sparse_mla.page_partial(*query, pages[LATENT], pages[ROPE_KEY], page_start, positions, valid,
                                       module.scaling)

    def sparse_grads(self, index, query, pages, page_start, positions, valid, lse, d_out, delta):
        """One page's share of the gradients given the merged lse and delta: (d query, {stream: d rows})."""
        module = self.layers[index].self_attn
        d_q_lat, d_q_rope, d_latent, d_rope = sparse_mla.page_grads(*query, pages[LATENT], pages[ROPE_KEY],
                                                                    page_start, positions, valid, lse, d_out, delta,
                                                                    module.scaling)
        return (d_q_lat, d_q_rope), {LATENT: d_latent, ROPE_KEY: d_rope}

    # -- the segment -------------------------------------------------------------------------------------
    def _layer(self, index, layer, hidden, cos, sin, start, past, positions, valid, remote=None, selected=None):
        """One decoder layer: (hidden out, the selection it used (positions, valid), its rows...); selected:
        attention_forward's."""
        h = layer.input_layernorm(hidden)
        selection = None if positions is None else (positions, valid)
        mixed, rows, selection = self.attention_forward(index, layer.self_attn, h, cos, sin, start,
                                                        list(past.get(index, [])), selection, remote, selected)
        return (self.mlp_residual(index, hidden + mixed), *selection, *rows)

    def _recomputed_layer(self, index, layer, hidden, cos, sin, start, past, code, remote, kept):
        """_layer as the prefix pass's re-entrant checkpoint runs it, forward then recompute in backward: the
        selection comes in and goes out as int32 codes [T, K] (encode_selection: what the checkpoints keep of it
        between layers), and kept (layer -> codes) holds each full indexer layer's own selection from the forward,
        which its recompute reuses instead of selecting again (the same inputs give the same selection)."""
        own = kept.get(index)
        positions, valid = (None, None) if code is None else decode_selection(code)
        hidden, positions, valid, *rows = self._layer(index, layer, hidden, cos, sin, start, past, positions, valid,
                                                      remote, None if own is None else decode_selection(own))
        if layer.self_attn.indexer is not None:  # a shared layer passes its input's codes on, the same tensor
            code = own if own is not None else encode_selection(positions, valid)
            kept[index] = code
        return (hidden, code, *rows)

    def layer_rows(self, index, hidden_1TC, cos, sin):
        """Layer `index`'s rows of the tokens whose layer input is hidden_1TC, in its streams' order (latent, rope
        key[, indexer key]), and nothing else: no query, selection, attention or MLP."""
        layer = self.layers[index]
        module = layer.self_attn
        h = layer.input_layernorm(hidden_1TC)
        rows = self.mla_rows(module, h, cos, sin)
        if module.indexer is not None:
            rows += (self.indexer_key(module.indexer, h, cos, sin),)
        return rows

    def forward_segment(self, ids, start, carry, past, remote_attention=None, prefix_recompute=False,
                        known_attention=None, need_hidden=True):
        """Run tokens `ids` (positions start .. start+T-1) through every layer.

        carry: unused (no layer carries per-sequence state); past: layer -> list of row tuples (latent, rope key
        [, indexer key]) token-major that precede this segment, in position order up to start-1 (the prompt's
        pages, earlier replay blocks) from position 0, or from remote_attention.end; remote_attention: None, or
        (context parallelism) the earlier keys on other ranks (attention_forward's `remote`);
        prefix_recompute: keep only each layer's input for backward and recompute the layer there (re-entrant, as
        the qwen3_5 adapter does, so ZeRO-3 gathers the layer's weights again; the caller sees to it that no layer's
        forward then makes a remote exchange). known_attention: layer -> (its kept selection [topk, T],) of this
        segment (kept_selection; exact mode's prefix pass with prefix_keep_attention) for full indexer layers: those
        layers attend that selection and score no key (the segment's forward and its recompute alike).
        Without autograd (the capture), out.attention holds each full indexer layer's selection in the same form,
        for the capture to keep.

        With prefix_recompute a selection travels between the layers' checkpoints as int32 codes [T, K] (the
        position, -1 where none), and each full indexer layer's codes made in the forward are reused by the layer's
        recompute in backward instead of selecting again (_recomputed_layer): the next layer's checkpoint holds the
        same tensor as its input anyway, so this keeps no more bytes than that, 4 per selected row and query and
        full indexer layer (offload/plan.py counts them: "prefix_selections").

        need_hidden False: no one reads the segment's hidden states, nor the last layer's selection (a capture,
        whose later tokens read only its rows): the last layer computes its rows alone (layer_rows; any kept
        selection of it is not used), and out.hidden is None."""
        topk = self.config.index_topk
        known = {}  # layer -> the selection codes [T, K] kept from capture
        for index, kept in (known_attention or {}).items():
            if self.layers[index].self_attn.indexer is None:
                raise ValueError(f"glm_moe_dsa layer {index}: a kept selection for a shared indexer layer (it "
                                 "reuses the last full layer's)")
            known[index] = known_selection(kept[0], start, ids.numel(), topk)
        hidden = self.embed(ids)
        cos, sin = self.rotary(hidden, start)
        out = SegmentOutput(hidden=None)
        past = past if past is not None else {}
        positions = valid = None  # the last full indexer layer's selection
        code = None  # the same as int32 codes, where each layer is recomputed in backward
        kept = dict(known)  # the full indexer layers' own selections (codes), from the forward for their recompute
        last = len(self.specs) - 1
        for index, layer in enumerate(self.layers[: len(self.specs)]):
            if index == last and not need_hidden:
                out.rows[index] = self.layer_rows(index, hidden, cos, sin)
                return out
            if prefix_recompute and torch.is_grad_enabled():
                # Re-entrant: the backward recomputes the layer and back-propagates through it at once (ZeRO-3
                # gathers the weights again for it); the prompt pages inside `past` get their gradients from that
                # inner backward, like the parameters.
                if not hidden.requires_grad:
                    hidden = hidden.detach().requires_grad_(True)
                hidden, code, *rows = torch.utils.checkpoint.checkpoint(
                    self._recomputed_layer, index, layer, hidden, cos, sin, start, past, code, remote_attention,
                    kept, use_reentrant=True)
            else:
                selected = None if index not in known else decode_selection(known[index])
                hidden, positions, valid, *rows = self._layer(index, layer, hidden, cos, sin, start, past,
                                                              positions, valid, remote_attention, selected)
            out.rows[index] = tuple(rows)
            if layer.self_attn.indexer is not None and not torch.is_grad_enabled():  # what the capture keeps
                out.attention[index] = (kept_selection(encode_selection(positions, valid), topk),)
        out.hidden = hidden
        return out

    # -- a decode step of G samples at once (ds_longstraw.rollout.generate) --------------------------------------------
    def decode_step(self, ids_G, position, carry, past, own, remote_attention=None, slots=None):
        """One token of each of G sequences that share the prompt's rows (arch/decode.py), at `position` (an int for
        all, or [G] positions: samples whose responses hold observations of different lengths).

        The G tokens run as one segment of G tokens for everything that is per token (projections, indexer inputs,
        norms, the MoE block), each at its sample's position. Per full indexer layer each sample selects its own
        canonical top-k among the prompt's indexer keys (one candidates pass for all samples over the shared pages,
        or remote_attention.candidates under context parallelism) and its own response keys, merged in canonical
        order as dsa_select does; the absorbed attention then takes the prompt rows' partial (page by page, or
        remote_attention.attend) and its own selected rows' partial, merged by LSE. The own rows' scores and partial
        are one batched call over the running samples' slots (OwnRows.batch_rows: samples at different lengths
        padded to the longest, the rows past each one's count masked out; stopped slots between running ones
        computed and dropped); the per-sample calls are the plain reference. carry: unused; past: layer -> the
        prompt's row tuples (shared); own: arch/decode.OwnRows, each sample's earlier response rows (at the
        positions just before its own) in slots `slots` (None: 0 .. G-1): this step's rows are written there at
        each slot's length (the caller advances the lengths). Returns hidden [G, 1, C] (before the final norm) and
        rows: layer -> this step's rows [G, ...] per stream."""
        tokens = ids_G.numel()
        slots = list(range(tokens)) if slots is None else slots
        hidden = self.embed(ids_G)  # [1, G, C]: the samples as the tokens of one segment
        position_G = (position.to(hidden.device) if isinstance(position, torch.Tensor)
                      else torch.full((tokens,), position, device=hidden.device))
        cos, sin = self.body.rotary_emb(hidden, position_G.view(1, tokens))
        # each sample's own rows sit at the positions just before its own: the first at position - length
        first_own = [int(position_G[g]) - own.lengths[slot] for g, slot in enumerate(slots)]
        out = SegmentOutput(hidden=None)
        selection = None
        for index, layer in enumerate(self.layers[: len(self.specs)]):
            module = layer.self_attn
            h = layer.input_layernorm(hidden)
            q_nope, q_rope, q_resid, latent, k_rope = self.mla_projections(module, h, cos, sin)
            rows = (latent, k_rope)
            shared = list(past.get(index, []))
            first = 0 if remote_attention is None else remote_attention.end
            if module.indexer is not None:
                query, weights, key = self.indexer_inputs(module.indexer, h, q_resid, cos, sin)
                rows = (latent, k_rope, key)
            own.write(index, slots, rows)
            # the running slots' rows as one batch (OwnBatch: one batched call), or, where batch_rows is refused
            # (tests), each sample's rows (one call per sample: the plain reference)
            mine = own.batch_rows(index, slots, extra=1) or [own.rows(index, slot, extra=1) for slot in slots]
            if module.indexer is not None:
                own_keys = mine if isinstance(mine, OwnBatch) else [rows_g[2] for rows_g in mine]
                selection = _decode_selection(module.indexer, query, weights, shared, first, own_keys, first_own,
                                              remote_attention, index, position_G)
            w_uk, w_uv = self.absorbed_maps(module)
            q_lat = torch.einsum("thn,rhn->thr", q_nope, w_uk)
            o_lat = _decode_attention(q_lat, q_rope, shared, first, mine, first_own, selection, module.scaling,
                                      remote_attention, index)
            mixed = module.o_proj(torch.einsum("thr,rhv->thv", o_lat, w_uv).reshape(1, tokens, -1))
            hidden = self.mlp_residual(index, hidden + mixed)
            out.rows[index] = rows
        out.hidden = hidden.transpose(0, 1)
        return out


def _decode_selection(indexer, query, weights, shared, first, own_keys, first_own, remote, index, position_G):
    """(positions, valid) [G, min(topk, last position + 1)]: each sample's canonical top-k among the prompt's
    indexer keys (the shared segments from position `first`; before it, remote's) and its own keys at positions
    first_own[g] .. (own_keys: an OwnBatch whose third stream is the indexer keys, _own_candidates_batched; or a
    list of each sample's [T_g, D], _own_candidates_each), merged in canonical order."""
    topk, scale = indexer.index_topk, indexer.softmax_scale
    best = None if remote is None else remote.candidates(index, (query, weights))
    start = first
    for piece in shared:
        best = dsa.extend_candidates(best, query, weights, piece[2], start, None, topk, scale)
        start += piece[0].shape[0]
    acc = score_dtype(query.dtype)
    own_candidates = _own_candidates_batched if isinstance(own_keys, OwnBatch) else _own_candidates_each
    scores_GS, positions_GS = own_candidates(query, weights, own_keys, first_own, scale)
    if best is None:
        best = dsa.no_candidates(query.shape[0], acc, query.device)
    best = dsa.merge_candidates((best[0].to(acc), best[1]), (scores_GS, positions_GS), topk)
    return dsa.candidates_selection(best, min(topk, int(position_G.max()) + 1))


def _own_candidates_batched(query, weights, own, first_own, scale):
    """(scores [G, W], positions [G, W]) of each running sample's own indexer keys (own: an OwnBatch, OwnRows.
    batch_rows, its third stream the keys [S, W, D]; a sample's keys at positions first_own[g] ..), as the model's
    indexer scores them (ReLU of the heads' scores, weighted sum), in score_dtype; past a sample's count, -inf at
    position 0 (as _own_candidates_each pads). query [G, I, D], weights [G, I]. One call over all S slots, the
    stopped ones' dropped."""
    acc = score_dtype(query.dtype)
    keys_SWD = own.rows[2]
    with torch.no_grad():  # as the model's indexer: no gradient; batched matmuls over the keys in place
        scores_SIW = torch.matmul(own.spread(query, 0.0).to(acc), keys_SWD.to(acc).transpose(1, 2))
        scores_SIW = scores_SIW.mul_(scale).relu_()
        scores_GW = own.pick(torch.matmul(own.spread(weights, 0.0).to(acc).unsqueeze(1), scores_SIW).squeeze(1))
    first_G = torch.tensor(first_own, dtype=torch.long, device=query.device)
    positions_GW = first_G.unsqueeze(1) + torch.arange(keys_SWD.shape[1], device=query.device)
    counted_SW = own.counted_SW()
    if counted_SW is not None:
        counted_GW = own.pick(counted_SW)
        scores_GW = scores_GW.masked_fill(~counted_GW, float("-inf"))
        positions_GW = positions_GW.masked_fill(~counted_GW, 0)
    return scores_GW, positions_GW


def _own_candidates_each(query, weights, own_keys, first_own, scale):
    """_own_candidates_batched one sample at a time (the plain reference; own_keys[g] [T_g, D], each sample's own):
    (scores [G, S], positions [G, S]) with S the most keys of any sample, a sample's missing candidates padded with
    -inf at position 0 (none)."""
    acc = score_dtype(query.dtype)
    width = max(keys.shape[0] for keys in own_keys)
    scores_GS = torch.full((query.shape[0], width), float("-inf"), dtype=acc, device=query.device)
    positions_GS = torch.zeros((query.shape[0], width), dtype=torch.long, device=query.device)
    with torch.no_grad():  # as the model's indexer: no gradient
        for g, keys_TD in enumerate(own_keys):
            scores_IT = torch.relu(torch.einsum("id,td->it", query[g].to(acc), keys_TD.to(acc)) * scale)
            scores_GS[g, : keys_TD.shape[0]] = torch.einsum("i,it->t", weights[g].to(acc), scores_IT)
            positions_GS[g, : keys_TD.shape[0]] = torch.arange(first_own[g], first_own[g] + keys_TD.shape[0],
                                                               device=query.device)
    return scores_GS, positions_GS


def _decode_attention(q_lat, q_rope, shared, first, own, first_own, selection, scale, remote, index):
    """o_lat [G, H, R] of each sample over its selected rows: the prompt's (the shared segments from `first`, and
    remote's before it) and its own at positions first_own[g] .. (own: an OwnBatch of (latent [S, W, R], k_rope
    [S, W, E], ...), _own_partial_batched; or a list of each sample's tuple (latent [T_g, R], k_rope [T_g, E], ...),
    _own_partial_each)."""
    acc = torch.float64 if q_lat.dtype == torch.float64 else torch.float32
    own_partial = _own_partial_batched if isinstance(own, OwnBatch) else _own_partial_each
    out, lse = own_partial(q_lat, q_rope, own, first_own, selection, scale)
    positions, valid = selection
    start = first
    for piece in shared:
        part, part_lse = sparse_mla.page_partial(q_lat, q_rope, piece[0], piece[1], start, positions, valid, scale)
        out, lse = merge_partials(out, lse, part.to(acc), part_lse.to(acc))
        start += piece[0].shape[0]
    if remote is not None:
        part, part_lse = remote.attend(index, (q_lat, q_rope), positions, valid)
        out, lse = merge_partials(out, lse, part.to(acc), part_lse.to(acc))
    return out.to(q_lat.dtype)


def _own_partial_batched(q_lat, q_rope, own, first_own, selection, scale):
    """(o_lat [G, H, R], lse [G, H]) in max(float32, dtype) of each running sample's query (q_lat [G, H, R], q_rope
    [G, H, E]) over the own rows it selected (selection: (positions, valid) [G, X]) among its rows in own (an
    OwnBatch, OwnRows.batch_rows: (latent [S, W, R], k_rope [S, W, E], ...), a sample's rows at positions
    first_own[g] .., those past its count never chosen); (0, -inf) where it selected none. One call over all S
    slots (the stopped ones' dropped), reading whichever is fewer rows per slot: all W own rows, the unselected
    masked (a one-turn rollout: W, the response so far, below X = index_topk), or the X selected ones, gathered,
    the slots that are not its own masked (after observations: W past X)."""
    positions, valid = own.spread(selection[0], 0), own.spread(selection[1], False)
    lat_SWR, rope_SWE = own.rows[0], own.rows[1]
    slots, rows = lat_SWR.shape[:2]
    acc = torch.float64 if q_lat.dtype == torch.float64 else torch.float32
    first_S = own.spread(torch.tensor(first_own, dtype=torch.long, device=q_lat.device), 0)
    counts_S = torch.full((slots,), rows, device=q_lat.device) if own.lengths_S is None else own.lengths_S
    offset_SX = positions - first_S.unsqueeze(1)
    inside_SX = valid & (offset_SX >= 0) & (offset_SX < counts_S.unsqueeze(1))
    if rows <= positions.shape[1]:  # every own row, the selected ones by offset (the rest land in a spare column)
        chosen_SY = torch.zeros((slots, rows + 1), dtype=torch.bool, device=q_lat.device)
        chosen_SY = chosen_SY.scatter_(1, torch.where(inside_SX, offset_SX, rows), True)[:, :rows]
        lat_SYR, rope_SYE = lat_SWR.to(acc), rope_SWE.to(acc)
    else:  # the selected rows (a canonical selection's positions are distinct); the others read row 0, masked
        at_SX = torch.where(inside_SX, offset_SX, 0)
        slot_S1 = torch.arange(slots, device=q_lat.device).unsqueeze(1)
        chosen_SY, lat_SYR, rope_SYE = inside_SX, lat_SWR[slot_S1, at_SX].to(acc), rope_SWE[slot_S1, at_SX].to(acc)
    scores_SHY = (torch.einsum("shr,syr->shy", own.spread(q_lat, 0.0).to(acc), lat_SYR)
                  + torch.einsum("she,sye->shy", own.spread(q_rope, 0.0).to(acc), rope_SYE)) * scale
    scores_SHY = scores_SHY.masked_fill(~chosen_SY.unsqueeze(1), float("-inf"))
    lse_SH = torch.logsumexp(scores_SHY, dim=-1)  # -inf where none of its own rows was selected
    probs_SHY = torch.exp(scores_SHY - torch.where(torch.isinf(lse_SH), torch.zeros_like(lse_SH), lse_SH).unsqueeze(-1))
    return own.pick(torch.einsum("shy,syr->shr", probs_SHY, lat_SYR)), own.pick(lse_SH)


def _own_partial_each(q_lat, q_rope, own, first_own, selection, scale):
    """_own_partial_batched one sample at a time (the plain reference; own[g] = (latent [T_g, R], k_rope [T_g, E],
    ...), each sample's own); reads only the rows each selected."""
    positions, valid = selection
    acc = torch.float64 if q_lat.dtype == torch.float64 else torch.float32
    outs, lses = [], []
    for g, rows_g in enumerate(own):
        count = rows_g[0].shape[0]
        mine = valid[g] & (positions[g] >= first_own[g]) & (positions[g] < first_own[g] + count)
        chosen = positions[g][mine] - first_own[g]
        lat_SR, rope_SE = rows_g[0][chosen].to(acc), rows_g[1][chosen].to(acc)
        scores_HS = (torch.einsum("hr,sr->hs", q_lat[g].to(acc), lat_SR)
                     + torch.einsum("he,se->hs", q_rope[g].to(acc), rope_SE)) * scale
        lse_H = torch.logsumexp(scores_HS, dim=-1)  # -inf where none of its own rows was selected
        probs_HS = torch.exp(scores_HS - torch.where(torch.isinf(lse_H), torch.zeros_like(lse_H), lse_H).unsqueeze(-1))
        outs.append(torch.einsum("hs,sr->hr", probs_HS, lat_SR))
        lses.append(lse_H)
    return torch.stack(outs), torch.stack(lses)


def _roped(x, cos, sin, unsqueeze_dim=1):
    """x roped interleaved as the model ropes its queries and keys: the rotation is elementwise per tensor, so one
    tensor alone (its partner argument a one-head slice of itself, discarded) equals its share of the joint call."""
    return apply_rotary_pos_emb_interleave(x, x.narrow(unsqueeze_dim, 0, 1), cos, sin, unsqueeze_dim=unsqueeze_dim)[0]


def _past_start(index, past, start, remote):
    """Where the pieces of `past` start: they must cover positions up to start-1 from 0 (one rank: the whole prompt
    lives here) or from remote.end (the positions before it live on other ranks)."""
    covered = sum(piece[0].shape[0] for piece in past)
    first = 0 if remote is None else remote.end
    if first + covered != start:
        raise ValueError(f"glm_moe_dsa layer {index}: the past covers {covered} positions from {first}, the segment "
                         f"starts at {start}")
    return first


FAMILY = Family(name="glm_moe_dsa", model_types=("glm_moe_dsa",), adapter=GlmMoeDsaAdapter,
                state_specs=state_specs, kernel_dims=kernel_dims, lora_targets=tuple(LORA_TARGETS),
                zero3_leaf_modules=zero3_leaf_modules, expert_shape=expert_shape, shard_experts=shard_experts,
                expert_parallel=expert_parallel, unregister_slices=unregister_slices)
