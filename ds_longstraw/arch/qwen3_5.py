"""Adapter for transformers' qwen3_5 hybrid models (Gated DeltaNet + gated full attention).

It runs one *segment* of tokens (a capture chunk, a replay block, a prefix-pass chunk) through the decoder stack,
starting from carried state, by calling the model's own submodules: the adapter never copies a weight, so the
same code serves a plain model, a peft-wrapped one and a ZeRO-3 partitioned one (whose hooks gather each
submodule's weights when it is called).

Legend: T tokens of the segment, C hidden size, H/K query/kv heads, D head dim; K/V pages are token-major
[T, K, D]; GDN recurrent state [1, Hv, dk, dv] (float32, float64 for float64 models); conv tail [1, conv_dim, k-1]
(the last k-1 tokens of the pre-convolution projection).
"""

from functools import partial

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from transformers.activations import ACT2FN
from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

from ds_longstraw.kernels import attention_with_past, chunk_gated_delta_rule, merge_partials, recurrent_gated_delta_rule
from ds_longstraw.kernels.dispatch import record

from .base import CausalLMAdapter, SegmentOutput
from .decode import decode_attention
from .family import Family
from .qwen3_5_graph import replay_graph
from .qwen3_5_scan import forward_replaced
from .qwen3_5_scan_backward import GdnScanGrad
from .specs import Carry, LayerState, Stream, carry_layers, paged_layers

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
# Linear layers that LoRA adapters attach to by default: attention and GDN projections and the MLP.
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                "out_proj", "gate_proj", "up_proj", "down_proj"]


def config_fields(fields) -> dict:
    """A shape config's fields (configs/models/) as transformers' config takes them: `full_attention_interval` n
    (every n-th layer full attention, the rest Gated DeltaNet) becomes `layer_types`."""
    fields = dict(fields)
    interval = fields.pop("full_attention_interval", None)
    if interval is not None and "layer_types" not in fields:
        fields["layer_types"] = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
                                 for i in range(fields["num_hidden_layers"])]
    return fields


def state_specs(config, dtype) -> list:
    """What every layer of a qwen3_5 model of `config` retains (specs.py), for a model computing in `dtype`.

    full attention: K and V per token (after k_norm and RoPE), [K, D] each; exact mode's kept attention: the
    output [H, D] and the log-sum-exp [H] per token. Gated DeltaNet: the recurrent state [1, Hv, dk, dv] (float32;
    float64 for float64 models) and the conv tail [1, conv_dim, k-1] per sequence."""
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    layers = list(config.layer_types)[: config.num_hidden_layers]
    unknown = set(layers) - {FULL_ATTENTION, LINEAR_ATTENTION}
    if unknown:
        raise ValueError(f"qwen3_5 adapter: unknown layer types {sorted(unknown)}")
    kv, heads = config.num_key_value_heads, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    hv, dk, dv = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
    conv_dim = 2 * config.linear_num_key_heads * dk + hv * dv
    specs = []
    for index, kind in enumerate(layers):
        if kind == FULL_ATTENTION:
            specs.append(LayerState(
                index, kind, "attention_kv_pages", combine="lse",
                streams=(Stream("k", (kv, head_dim), dtype), Stream("v", (kv, head_dim), dtype)),
                kept=(Stream("o", (heads, head_dim), dtype, grad=False),
                      Stream("lse", (heads,), state_dtype, grad=False))))
        else:
            specs.append(LayerState(
                index, kind, "gdn_state", combine="affine_scan",
                carry=(Carry("state", (1, hv, dk, dv), state_dtype),
                       Carry("conv_tail", (1, conv_dim, config.linear_conv_kernel_dim - 1), dtype))))
    return specs


def kernel_dims(config) -> dict:
    """What the planner's kernel workspaces scale with (arch.kernel_dims)."""
    text = getattr(config, "text_config", None) or config
    return {"vocab_size": text.vocab_size, "hidden_size": text.hidden_size,
            "attention_heads": text.num_attention_heads, "attention_head_dim": text.head_dim,
            "attention_kv_heads": text.num_key_value_heads, "delta_heads": text.linear_num_value_heads,
            "delta_head_dims": text.linear_key_head_dim + text.linear_value_head_dim}


def _delta_rule(query, key, value, g, beta, state):
    if query.shape[1] == 1 and not torch.is_grad_enabled() and query.device.type == "cpu":
        # One token without a graph (a decode step): the token loop. The chunked rule pads it to a 64-token chunk,
        # whose temporaries grow with a decode batch's samples (~10 MiB at G = 8 on the small shape).
        record("gated delta rule", "torch_token_loop")
        return recurrent_gated_delta_rule(query, key, value, g=g, beta=beta, initial_state=state,
                                          output_final_state=True, use_qk_l2norm_in_kernel=True)
    return chunk_gated_delta_rule(query, key, value, g=g, beta=beta, initial_state=state, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True)


class Qwen35Adapter(CausalLMAdapter):
    family = "qwen3_5"
    # its "affine_scan" layers run in the layer-major CP prefix pass (recurrent_scan gives their backward too): what
    # a family with such layers declares (grpo/topology.resolve_prefix)
    layer_major_scan = True

    def __init__(self, model):
        self.model = model
        lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        body = lm.model
        if hasattr(body, "language_model"):  # Qwen3_5ForConditionalGeneration: text stack inside
            body = body.language_model
        self.lm_head = lm.lm_head
        self.body = body
        self.config = body.config
        self.layers = body.layers
        self.layer_types = list(self.config.layer_types)[: self.config.num_hidden_layers]
        self.specs = state_specs(self.config, self.dtype)
        self.paged_layers = paged_layers(self.specs)  # full attention: K/V pages
        self.carry_layers = carry_layers(self.specs)  # Gated DeltaNet: recurrent state + conv tail

    # -- pieces ------------------------------------------------------------------------------------------
    def gdn_inputs(self, module, h_1TC, tail, with_gate=True):
        """What a GDN layer's delta rule reads: projections, the causal convolution continuing `tail` (None: the
        prompt start) and the gates. Returns (query, key, value, g, beta, z, new_tail); z (the output gate) is None
        without with_gate (a caller that computes it later, gdn_gate)."""
        batch, t, _ = h_1TC.shape
        kernel = module.conv_kernel_size
        mixed = module.in_proj_qkv(h_1TC).transpose(1, 2)
        z = self.gdn_gate(module, h_1TC) if with_gate else None
        b = module.in_proj_b(h_1TC)
        a = module.in_proj_a(h_1TC)
        if tail is None:  # the start of the prompt: the causal convolution sees zeros before it
            tail = mixed.new_zeros(batch, module.conv_dim, kernel - 1)
        full = torch.cat([tail.to(mixed.dtype), mixed], dim=-1)
        # A copy, not a view: a view would keep the whole [1, conv_dim, k-1+T] projection alive for as long as the
        # carry lives (a checkpointed boundary, the prompt's final carry).
        new_tail = full[:, :, full.shape[-1] - (kernel - 1):].clone()
        # The module pads k-1 on both sides; output i then covers inputs [i-k+1, i] of `full`.
        conv = module.conv1d(full.to(module.conv1d.weight.dtype))[:, :, kernel - 1: kernel - 1 + t]
        mixed = ACT2FN[module.activation](conv).to(mixed.dtype).transpose(1, 2)
        query, key, value = torch.split(mixed, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
        query = query.reshape(batch, t, -1, module.head_k_dim)
        key = key.reshape(batch, t, -1, module.head_k_dim)
        value = value.reshape(batch, t, -1, module.head_v_dim)
        beta = b.sigmoid()
        g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)  # as the model defines it
        return query, key, value, g, beta, z, new_tail

    def gdn_core(self, module, h_1TC, state, tail):
        """The delta rule's output [1, T, Hv, dv], the output gate z, the end state and the end conv tail of the
        layer input h_1TC from (state, tail) (None: the prompt start), before the gated norm and out projection."""
        query, key, value, g, beta, z, new_tail = self.gdn_inputs(module, h_1TC, tail)
        # The chunked rule keeps only its inputs for backward (kernels/gated_delta/chunked.py): its intermediates
        # are ~10x their size, and the exact-mode prefix pass holds a whole segment's graph.
        out, new_state = _delta_rule(query, key, value, g, beta, state)
        return out, z, new_state, new_tail

    def _gdn(self, module, h_1TC, state, tail):
        out, z, new_state, new_tail = self.gdn_core(module, h_1TC, state, tail)
        return self.gdn_finish(module, out, z), new_state, new_tail

    def gdn_gate(self, module, h_1TC):
        """The output gate z [1, T, Hv, dv] of the layer input h_1TC."""
        return module.in_proj_z(h_1TC).reshape(h_1TC.shape[0], h_1TC.shape[1], -1, module.head_v_dim)

    def gdn_finish(self, module, out_1THV, z):
        """The layer's output [1, T, C] from the delta rule's output [1, T, Hv, dv]: gated norm, out projection."""
        batch, t = out_1THV.shape[:2]
        out = module.norm(out_1THV.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
        return module.out_proj(out.reshape(batch, t, -1))

    def gdn_forward(self, module, h_1TC, state, tail):
        # Under ZeRO-3 the module's hooks wrap its inputs and outputs (re-gathering A_log and dt_bias before this
        # module's backward): so h goes in as an input and (out, state, tail) come back as the module's outputs.
        def forward(h):
            return self._gdn(module, h, state, tail)

        with forward_replaced(module, forward):
            return tuple(module(h_1TC))

    def attention_qkv(self, module, h_1TC, cos, sin):
        """query [1, H, T, D] (after q_norm, RoPE), output gate [1, T, H*D], key and value [1, K, T, D]."""
        batch, t, _ = h_1TC.shape
        d = module.head_dim
        query, gate = torch.chunk(module.q_proj(h_1TC).view(batch, t, -1, d * 2), 2, dim=-1)
        gate = gate.reshape(batch, t, -1)
        query = _roped(module.q_norm(query).transpose(1, 2), cos, sin)
        key, value = self.attention_rows(module, h_1TC, cos, sin)
        return query, gate, key, value

    def attention_rows(self, module, h_1TC, cos, sin):
        """key (after k_norm, RoPE) and value [1, K, T, D]: the rows an attention layer pages, all that later tokens
        read of it."""
        batch, t, _ = h_1TC.shape
        d = module.head_dim
        key = module.k_norm(module.k_proj(h_1TC).view(batch, t, -1, d)).transpose(1, 2)
        value = module.v_proj(h_1TC).view(batch, t, -1, d).transpose(1, 2)
        return _roped(key, cos, sin), value

    def attention_output(self, module, out_HTD, gate):
        """The gated output projection of attention results out_HTD [H, T, D]."""
        out = out_HTD.transpose(0, 1).reshape(1, out_HTD.shape[1], -1) * torch.sigmoid(gate)
        return module.o_proj(out)

    def attention_forward(self, module, h_1TC, cos, sin, past, remote=None, known=None, remote_keys=None):
        """Returns (layer output, K, V, (out_HTD, lse_HT)). remote: None, or a callable q_HTD -> (out_HTD, lse_HT)
        over keys held elsewhere (context-parallel pages), merged with the local partial by LSE; known: the
        (out_HTD, lse_HT) of this same segment kept from capture (exact mode's prefix pass), not recomputed. With
        both, remote(q_HTD, known=(out, lse)) passes the merged result through and adds the remote keys' share of
        the gradients in backward. remote_keys: instead of remote (which is then None), the other ranks' keys as a
        request that runs while the local keys are attended (the prefix pass's turns, grpo/cp/prefix_turns.RemoteKeys),
        forward and backward, merged inside attention_with_past."""
        query, gate, key, value = self.attention_qkv(module, h_1TC, cos, sin)
        past_KTD = [(k.transpose(0, 1), v.transpose(0, 1)) for k, v in past]
        sinks = [getattr(pair, "grad_sink", None) for pair in past]  # exact mode's prompt pages (StagedPast)
        out_HTD, lse_HT = attention_with_past(query[0], past_KTD, key[0], value[0], module.scaling, sinks=sinks,
                                              known=known, remote=remote_keys)
        if remote is not None and known is not None:
            # the kept result is already merged over every rank's keys: only the remote gradient path is left
            out_HTD, lse_HT = remote(query[0], known=(out_HTD, lse_HT))
        elif remote is not None:
            remote_out, remote_lse = remote(query[0])
            out_HTD, lse_HT = merge_partials(out_HTD, lse_HT, remote_out, remote_lse.to(lse_HT.dtype))
        return (self.attention_output(module, out_HTD, gate), key[0].transpose(0, 1), value[0].transpose(0, 1),
                (out_HTD, lse_HT))

    # -- one layer, piece by piece (the layer-major capture under context parallelism) ---------------------
    # A decoder layer is hidden + mixer(input_norm(hidden)), then + mlp(post_norm(hidden)). The layer-major schedule
    # (ds_longstraw.grpo.cp.capture) runs the mixer over a whole shard with the exchanges its combine needs, so it
    # asks for the pieces: mixer_input, the mixer by its combine ("lse": attention_project / attention_finish;
    # "affine_scan": recurrent_scan, the layer's math under grpo/cp/kinds/scan/capture.py's schedule), and mlp_residual.
    def mixer_input(self, index, hidden_1TC):
        return self.layers[index].input_layernorm(hidden_1TC)

    def mlp_residual(self, index, hidden_1TC):
        """hidden + mlp(post_attention_layernorm(hidden)) of layer `index`."""
        layer = self.layers[index]
        return hidden_1TC + layer.mlp(layer.post_attention_layernorm(hidden_1TC))

    def attention_geometry(self):
        """(query heads, kv heads, head dim) of the attention layers (the "lse" combine's rows are K, V [K, D])."""
        return self.config.num_attention_heads, self.config.num_key_value_heads, self.config.head_dim

    def attention_scale(self, index):
        return self.layers[index].self_attn.scaling

    def attention_project(self, index, h_1TC, start):
        """q_HTD (after q_norm and RoPE at positions start..), what attention_finish needs (the output gate), and the
        segment's rows (K, V token-major [T, K, D]) of attention layer `index`."""
        cos, sin = self.rotary(h_1TC, start)
        query, gate, key, value = self.attention_qkv(self.layers[index].self_attn, h_1TC, cos, sin)
        return query[0], gate, (key[0].transpose(0, 1), value[0].transpose(0, 1))

    def attention_finish(self, index, out_HTD, gate):
        """The layer's mixer output [1, T, C] from the attention result out_HTD [H, T, D]."""
        return self.attention_output(self.layers[index].self_attn, out_HTD, gate)

    def scan_output_bytes(self, tokens):
        """Bytes the one-pass CP capture holds of one Gated DeltaNet layer's outputs over `tokens` tokens
        ([o(0) | q~] in the model's dtype, qwen3_5_scan.py; grpo/cp/kinds/scan/capture.py holds them)."""
        module = next(self.layers[i].linear_attn for i, kind in enumerate(self.layer_types) if kind == LINEAR_ATTENTION)
        return tokens * module.num_v_heads * (module.head_k_dim + module.head_v_dim) * self.dtype.itemsize

    def recurrent_scan(self, index):
        """Gated DeltaNet layer `index` as the context-parallel scan's math (grpo/interfaces.RecurrentScanGrad;
        qwen3_5_scan.py, qwen3_5_scan_backward.py): what the layer-major capture and prefix pass
        (grpo/cp/kinds/scan/) run it by."""
        return GdnScanGrad(self, self.layers[index].linear_attn, index)

    # -- the segment -------------------------------------------------------------------------------------
    def _layer(self, index, layer, hidden, cos, sin, carry, past, remote_attention, known_attention):
        """One decoder layer: (hidden out, state or K, conv tail or V, None or the attention's (out, lse))."""
        residual = hidden
        h = self.mixer_input(index, hidden)
        attention = None
        if self.layer_types[index] == LINEAR_ATTENTION:
            state, tail = carry.get(index, (None, None))
            mixed, first, second = self.gdn_forward(layer.linear_attn, h, state, tail)
        else:
            # a remote that takes its requests in two halves (the prefix pass's turns: its `keys`, which every
            # remote attention declares, None for the others) overlaps the local attention
            keys = None if remote_attention is None else remote_attention.keys
            remote_keys = None if keys is None else keys(index)
            remote = None if remote_attention is None or remote_keys is not None else partial(remote_attention, index)
            mixed, first, second, attention = self.attention_forward(
                layer.self_attn, h, cos, sin, past.get(index, []), remote, known_attention.get(index),
                remote_keys=remote_keys)
        return self.mlp_residual(index, residual + mixed), first, second, attention

    def _last_layer_state(self, index, layer, hidden, cos, sin, carry):
        """What later tokens read of layer `index` and nothing more: an attention layer's (K, V) rows, without its
        queries, attention or MLP; a Gated DeltaNet layer's (end state, conv tail), without its MLP."""
        h = self.mixer_input(index, hidden)
        if self.layer_types[index] == LINEAR_ATTENTION:
            _, state, tail = self.gdn_forward(layer.linear_attn, h, *carry.get(index, (None, None)))
            return state, tail
        key, value = self.attention_rows(layer.self_attn, h, cos, sin)
        return key[0].transpose(0, 1), value[0].transpose(0, 1)

    def forward_segment(self, ids, start, carry, past, remote_attention=None, prefix_recompute=False,
                        known_attention=None, need_hidden=True):
        """Run tokens `ids` (positions start .. start+T-1) through every layer.

        carry: layer -> (recurrent state, conv tail) before the segment (missing or None: zeros);
        past: layer -> list of (K, V) token-major segments that precede this one (prompt pages, earlier blocks);
        remote_attention: None, or a callable (layer, q_HTD, known=None) -> (out_HTD, lse_HT) over earlier keys that
        live on other context-parallel ranks (ds_longstraw.parallel); given `known` (a layer of known_attention),
        it returns that merged result and adds the remote share of the gradients in backward; its `keys` is None,
        or layer -> the request in two halves (grpo/interfaces.RemoteAttention);
        prefix_recompute: keep only each layer's input for backward and recompute the layer there (the exact-mode
        prefix pass holds a whole capture chunk's graph otherwise); the caller sees to it that a layer's forward
        makes no remote exchange then (LongstrawConfig.prefix_recompute_runs);
        known_attention: layer -> (out_HTD, lse_HT) of this segment's attention kept from capture (exact mode's
        prefix pass with prefix_keep_attention): those layers skip the attention itself (ds_longstraw.kernels).
        The result's `attention` holds every attention layer's (out_HTD, lse_HT).
        need_hidden False: no one reads the segment's hidden states, nor the last layer's attention (a capture,
        whose later tokens read only its rows and carries): the last layer computes those alone
        (_last_layer_state; any known attention of it is not used), and out.hidden is None.
        """
        hidden = self.embed(ids)
        cos, sin = self.rotary(hidden, start)
        out = SegmentOutput(hidden=None)
        known_attention = known_attention or {}
        last = len(self.layer_types) - 1
        for index, layer in enumerate(self.layers[: len(self.layer_types)]):
            if index == last and not need_hidden:
                first, second = self._last_layer_state(index, layer, hidden, cos, sin, carry)
                (out.carry if self.layer_types[index] == LINEAR_ATTENTION else out.rows)[index] = (first, second)
                return out
            if prefix_recompute and torch.is_grad_enabled():
                # The re-entrant form: its backward recomputes the layer and back-propagates through it at once,
                # so ZeRO-3 gathers the layer's weights for the recompute and keeps them through its backward
                # (the non-re-entrant form would unpack tensors saved from weights ZeRO-3 has released since).
                # It differentiates only through tensor arguments that require grad: the hidden state always does
                # (under LoRA the embedding output does not); the GDN carry leaves, passed inside a dict, get their
                # gradients from the inner backward like the parameters.
                if not hidden.requires_grad:
                    hidden = hidden.detach().requires_grad_(True)
                results = torch.utils.checkpoint.checkpoint(self._layer, index, layer, hidden, cos, sin, carry,
                                                            past, remote_attention, known_attention,
                                                            use_reentrant=True)
            else:
                results = self._layer(index, layer, hidden, cos, sin, carry, past, remote_attention,
                                      known_attention)
            hidden, first, second, attention = results
            if self.layer_types[index] == LINEAR_ATTENTION:
                out.carry[index] = (first, second)
            else:
                out.rows[index] = (first, second)
                out.attention[index] = attention
        out.hidden = hidden
        return out

    # -- a decode step of G samples at once (ds_longstraw.rollout.generate) --------------------------------------------
    def decode_step(self, ids_G, position, carry, past, own, remote_attention=None, slots=None):
        """One token of each of G sequences that share the prompt's state (arch/decode.py), at `position` (an int
        for all, or [G] positions: samples whose responses hold observations of different lengths).

        carry: layer -> (recurrent state [G, ...], conv tail [G, ...]), each sample's own; past: layer -> the prompt's
        (K, V) segments, shared (a StagedPast, or empty under context parallelism, where remote_attention reaches
        them as in forward_segment); own: arch/decode.OwnRows, each sample's earlier response rows, in slots `slots`
        (the batch rows' slots; None: 0 .. G-1): this step's (K, V) are written there at each slot's length (the
        caller advances the lengths) and attended with them. Returns hidden [G, 1, C] (before the final norm), carry
        [G, ...] per layer, and rows: layer -> this step's (K, V) [G, K, D]."""
        slots = list(range(ids_G.numel())) if slots is None else slots
        hidden = self.body.embed_tokens(ids_G.to(self.device).view(-1, 1))
        if isinstance(position, torch.Tensor):
            cos, sin = self.body.rotary_emb(hidden, position.to(self.device).view(-1, 1))
        else:
            cos, sin = self.rotary(hidden, position)
        out = SegmentOutput(hidden=None)
        for index, layer in enumerate(self.layers[: len(self.layer_types)]):
            h = self.mixer_input(index, hidden)
            if self.layer_types[index] == LINEAR_ATTENTION:
                mixed, state, tail = self.gdn_forward(layer.linear_attn, h, *carry[index])
                out.carry[index] = (state, tail)
            else:
                module = layer.self_attn
                query, gate, key, value = self.attention_qkv(module, h, cos, sin)  # [G, H or K, 1, D]
                key, value = key[:, :, 0], value[:, :, 0]
                own.write(index, slots, (key, value))
                mine = own.batch_rows(index, slots, extra=1) or [own.rows(index, slot, extra=1) for slot in slots]
                remote = None if remote_attention is None else partial(remote_attention, index)
                out_GHD = decode_attention(query[:, :, 0], past.get(index, []), mine, module.scaling, remote)
                mixed = module.o_proj(out_GHD.reshape(out_GHD.shape[0], 1, -1) * torch.sigmoid(gate))
                out.rows[index] = (key, value)
            hidden = self.mlp_residual(index, hidden + mixed)
        out.hidden = hidden
        return out


def _roped(x, cos, sin):
    """x [B, heads, T, D] roped as the model ropes its queries and keys: the rotation is elementwise per tensor, so
    one tensor alone (its partner argument a one-head slice of itself, discarded) equals its share of the joint
    call."""
    return apply_rotary_pos_emb(x, x[:, :1], cos, sin)[0]


FAMILY = Family(name="qwen3_5", model_types=("qwen3_5", "qwen3_5_text"), adapter=Qwen35Adapter,
                state_specs=state_specs, kernel_dims=kernel_dims, config_fields=config_fields,
                lora_targets=tuple(LORA_TARGETS), replay_graph=replay_graph)
