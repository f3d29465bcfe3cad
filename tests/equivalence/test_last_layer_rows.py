"""A capture's last layer computes only what later tokens read of it (forward_segment's need_hidden=False).

No token reads a captured segment's hidden states (the prompt's last token is replayed with the members), so the last
layer's queries, attention and MLP over the prompt feed nothing. Proven for the last layer of every kind (qwen3_5:
full attention, Gated DeltaNet; glm_moe_dsa: a shared indexer layer, a full one):
  - forward_segment: with need_hidden=False the rows and carries equal bit for bit the whole layer's, after a past
    too, and the layer's MLP and query projection are never called (the modules' calls, counted);
  - a one-rank capture and exact mode's prefix pass run the last layer that way, and keep none of its attention
    for the prefix pass (prefix_keep_attention: glm_moe_dsa's selections by default, qwen3_5's outputs asked for);
  - exact mode's transaction then equals transformers' full-sequence autograd in float64, the attention kept or
    not, each layer recomputed in backward or not: relative L2 <= 1e-8 over all parameter gradients (the
    contract's, as in test_transaction.py: the sides differ only in the order of float64 sums, ~1e-15; a lost
    gradient path through the last layer's rows shows at 1e-3 or worse).
"""

import pytest
import torch
from glm_models import VOCAB, glm_reference, tiny_glm_moe_dsa
from grads import grads_of, relative_l2
from models import float64_model, full_sequence_logprobs, tiny_qwen3_5
from reference import reference_step

from ds_longstraw import GRPOGroup, GRPOObjective, grpo_backward
from ds_longstraw.arch import adapter_for
from ds_longstraw.config import parse_config
from ds_longstraw.grpo.state import capture_prefix

TOL = 1e-8
GDN, ATTENTION = "linear_attention", "full_attention"

MODELS = {
    # name: (builder, the reference's context)
    "qwen3_5-attention-last": (lambda: tiny_qwen3_5(), float64_model),
    "qwen3_5-gdn-last": (lambda: tiny_qwen3_5(layer_types=[GDN, ATTENTION, GDN, GDN]), float64_model),
    "glm_moe_dsa-shared-last": (lambda: tiny_glm_moe_dsa(), glm_reference),
    "glm_moe_dsa-full-last": (lambda: tiny_glm_moe_dsa(indexer_types=["full", "shared", "shared", "full"]),
                              glm_reference),
}
SETTINGS = {"capture_chunk": 9, "page_tokens": 5, "replay_block": 4}


@pytest.fixture(scope="module", params=list(MODELS))
def case(request):
    build, reference = MODELS[request.param]
    return build(), reference


def _group(prompt_len=41, response_lens=(5, 3, 7), seed=0):
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB, (prompt_len,), generator=gen)
    responses = [torch.randint(0, VOCAB, (n,), generator=gen) for n in response_lens]
    return GRPOGroup(prompt, responses, rewards=torch.rand(len(responses), generator=gen).tolist())


class _Calls:
    """Counts the calls of the last layer's MLP and of its first query projection."""

    def __init__(self, model):
        adapter = adapter_for(model)
        layer = adapter.layers[len(adapter.specs) - 1]
        mixer = getattr(layer, "self_attn", None)
        query = None if mixer is None else getattr(mixer, "q_proj", None) or getattr(mixer, "q_a_proj", None)
        self.mlp = self.query = 0
        self.hooks = [layer.mlp.register_forward_hook(lambda *_: self._count("mlp"))]
        if query is not None:
            self.hooks.append(query.register_forward_hook(lambda *_: self._count("query")))

    def _count(self, name):
        setattr(self, name, getattr(self, name) + 1)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()


def test_rows_alone_equal_the_whole_layers(case):
    model, reference = case
    adapter = adapter_for(model)
    ids = _group().prompt_ids
    with reference(), torch.no_grad():
        first = adapter.forward_segment(ids[:20], 0, {}, {})
        past = {layer: [rows] for layer, rows in first.rows.items()}
        whole = adapter.forward_segment(ids[20:], 20, first.carry, past)
        with _Calls(model) as calls:
            alone = adapter.forward_segment(ids[20:], 20, first.carry, past, need_hidden=False)
    assert alone.hidden is None and whole.hidden is not None
    assert calls.mlp == 0 and calls.query == 0
    assert set(alone.rows) == set(whole.rows) and set(alone.carry) == set(whole.carry)
    for mine, theirs in [(alone.rows, whole.rows), (alone.carry, whole.carry)]:
        for layer in theirs:
            for a, b in zip(mine[layer], theirs[layer], strict=True):
                assert torch.equal(a, b), layer


@pytest.mark.parametrize("keep_attention", [True, False])
def test_capture_and_prefix_pass_skip_what_no_token_reads(case, keep_attention):
    """The last layer's MLP runs over the members' tokens only (replay's blocks), never over the prompt; the kept
    attention's pages hold every kept layer's but the last one's."""
    model, reference = case
    group = _group()
    adapter = adapter_for(model)
    settings = {"prefix_grad": "exact", "prefix_keep_attention": keep_attention, **SETTINGS}
    with reference(), _Calls(model) as calls:
        state = capture_prefix(adapter, group.prompt_ids, parse_config(settings), "exact")
        names = {stream.name for spec in adapter.specs for stream in spec.kept}
        pages = {} if state.kept_pool is None else state.kept_pool.bytes_by_stream()
        kept = {layer for (layer, name), nbytes in pages.items() if name in names and nbytes}
        state.release()
    assert state.last_layer_whole is False and calls.mlp == 0
    expected = {spec.layer for spec in adapter.specs[:-1] if spec.kept} if keep_attention else set()
    assert kept == expected
    with reference(), _Calls(model) as calls:
        grpo_backward(model, group, GRPOObjective(), longstraw=settings)
    assert calls.mlp == sum(-(-n // SETTINGS["replay_block"]) for n in map(len, group.response_ids))
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("keep_attention,prefix_recompute", [(False, True), (False, False), (True, True)])
def test_exact_mode_matches_full_sequence_autograd(case, keep_attention, prefix_recompute):
    model, reference = case
    group = _group()
    objective = GRPOObjective()
    config = {"prefix_grad": "exact", "prefix_keep_attention": keep_attention, "prefix_recompute": prefix_recompute,
              **SETTINGS}
    with reference():
        ref_grads, (ref_loss, _, _) = reference_step(model, group, objective.group_loss, full_sequence_logprobs)
        grads, result = grads_of(model, lambda: grpo_backward(model, group, objective, longstraw=config))
    assert relative_l2(grads, ref_grads) <= TOL
    assert set(grads) == set(ref_grads)
    assert result.loss == pytest.approx(ref_loss, rel=1e-12, abs=1e-12)
