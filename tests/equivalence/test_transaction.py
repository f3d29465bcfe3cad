"""The GRPO transaction against independent float64 references.

Equivalence chains (float64 model, float64_model() making transformers compute in float64 end to end):
  grpo_backward(detached) == transformers cache continuation: no-grad prefill of prompt[:-1], then each member
                             continues with autograd on [prompt[-1], response[:-1]]
  grpo_backward(exact)    == full-sequence autograd of prompt + response for every member
  loss and per-member log-probs equal the references' in both modes.
Tolerance: relative L2 <= 1e-8 over all parameter gradients. Both sides compute the same functions in float64
in different orders (chunked vs whole-sequence attention and delta rule), which leaves ~1e-11; a wrong path
(a missing gradient term, a shifted position, a stale state) shows up at 1e-3 or worse.
"""

import pytest
import torch
from grads import grads_of, relative_l2
from models import cache_continuation_logprobs, float64_model, full_sequence_logprobs, tiny_qwen3_5
from reference import reference_step

from ds_longstraw import GRPOGroup, GRPOObjective, grpo_backward

TOL = 1e-8

CASES = {
    # name: (prompt length, response lengths, capture_chunk, page_tokens, replay_block, objective kwargs)
    "chunk-divides-prompt": (25, [5, 3], 8, 8, 64, {}),
    "chunk-and-page-do-not-divide": (30, [6, 4, 9], 7, 5, 4, {}),
    "G1": (19, [6], 5, 4, 3, {}),
    "one-token-responses": (21, [1, 1, 1], 6, 4, 2, {}),
    "seq-mean-token-mean": (23, [2, 7, 4], 9, 3, 5, {"loss_agg": "seq-mean-token-mean"}),
    "chunk-shorter-than-conv-tail": (17, [4, 5], 2, 3, 2, {"loss_agg": "token-mean", "scale_rewards": False}),
}


def _group(prompt_len, response_lens, seed=0, **extra):
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 97, (prompt_len,), generator=gen)
    responses = [torch.randint(0, 97, (n,), generator=gen) for n in response_lens]
    scores = torch.rand(len(responses), generator=gen).tolist()
    if len(responses) == 1:  # one member's scaled advantage is 0: give an advantage so there is a gradient
        return GRPOGroup(prompt, responses, advantages=[0.7], **extra)
    return GRPOGroup(prompt, responses, rewards=scores, **extra)


def _run(model, group, objective, mode, chunk, page, block, **kwargs):
    # "exact-graph": exact mode with the capture's graph kept where it fits (prefix_keep_graph "fits": these short
    # prompts' whole graph; grpo/kept_graph.py); "exact", the default, keeps none and recomputes every segment
    config = {"prefix_grad": mode.removesuffix("-graph"), "capture_chunk": chunk, "page_tokens": page,
              "replay_block": block, "prefix_keep_graph": "fits" if mode == "exact-graph" else False}
    return grads_of(model, lambda: grpo_backward(model, group, objective, longstraw=config, **kwargs))


def _reference(model, group, objective, logprob_fn, ref_model=None):
    grads, (loss, logps, _) = reference_step(model, group, objective.group_loss, logprob_fn,
                                             ref_model if objective.kl_coef > 0 else None)
    return grads, (loss, logps)


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3_5()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", ["detached", "exact", "exact-graph"])
def test_matches_reference(model, case, mode):
    prompt_len, response_lens, chunk, page, block, objective_kwargs = CASES[case]
    group = _group(prompt_len, response_lens)
    objective = GRPOObjective(**objective_kwargs)
    reference_fn = cache_continuation_logprobs if mode == "detached" else full_sequence_logprobs
    with float64_model():
        ref_grads, (ref_loss, ref_logps) = _reference(model, group, objective, reference_fn)
        grads, result = _run(model, group, objective, mode, chunk, page, block)
    assert relative_l2(grads, ref_grads) <= TOL
    assert result.loss == pytest.approx(ref_loss, rel=1e-12, abs=1e-12)
    for mine, ref in zip(result.logprobs, ref_logps, strict=True):
        torch.testing.assert_close(mine, ref.double(), rtol=0, atol=1e-11)


@pytest.mark.parametrize("mode", ["detached", "exact", "exact-graph"])
def test_kl_to_separate_reference_model(model, mode):
    ref_model = tiny_qwen3_5(seed=7)
    group = _group(22, [4, 6, 2], seed=3)
    objective = GRPOObjective(kl_coef=0.3)
    reference_fn = cache_continuation_logprobs if mode == "detached" else full_sequence_logprobs
    with float64_model():
        ref_grads, (ref_loss, _) = _reference(model, group, objective, reference_fn, ref_model=ref_model)
        grads, result = _run(model, group, objective, mode, 6, 4, 3, ref_model=ref_model)
        with torch.no_grad():
            expected_ref = reference_fn(ref_model, group.prompt_ids, group.response_ids)
    assert relative_l2(grads, ref_grads) <= TOL
    assert result.loss == pytest.approx(ref_loss, rel=1e-12)
    for mine, ref in zip(result.ref_logprobs, expected_ref, strict=True):
        torch.testing.assert_close(mine, ref.double(), rtol=0, atol=1e-11)
    assert not any(p.grad is not None for p in ref_model.parameters()), "the reference model must get no gradient"


@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_given_old_logprobs_with_active_clipping(model, mode):
    base = _group(20, [5, 4, 3], seed=5)
    # Old log-probs far from the current ones push ratios outside [1 - 0.1, 1 + 0.1]: clipping is active.
    gen = torch.Generator().manual_seed(11)
    with float64_model(), torch.no_grad():
        current = cache_continuation_logprobs(model, base.prompt_ids, base.response_ids)
    old = [lp + (torch.rand(lp.shape, generator=gen, dtype=torch.float64) - 0.5) for lp in current]
    group = GRPOGroup(base.prompt_ids, base.response_ids, rewards=base.rewards, old_logprobs=old)
    ratios = torch.cat([torch.exp(c - o) for c, o in zip(current, old, strict=True)])
    assert ((ratios < 0.9) | (ratios > 1.1)).any(), "test setup: clipping must be active"
    objective = GRPOObjective(clip_low=0.1, clip_high=0.1)
    reference_fn = cache_continuation_logprobs if mode == "detached" else full_sequence_logprobs
    with float64_model():
        ref_grads, (ref_loss, _) = _reference(model, group, objective, reference_fn)
        grads, result = _run(model, group, objective, mode, 6, 4, 3)
    assert relative_l2(grads, ref_grads) <= TOL
    assert result.loss == pytest.approx(ref_loss, rel=1e-12)


def test_exact_differs_from_detached(model):
    """The two modes must be distinguishable, or the tests above could not tell them apart."""
    group = _group(24, [5, 3])
    with float64_model():
        detached, _ = _run(model, group, GRPOObjective(), "detached", 7, 4, 4)
        exact, _ = _run(model, group, GRPOObjective(), "exact", 7, 4, 4)
    assert relative_l2(detached, exact) > 1e-3


def test_gradients_accumulate_into_existing_grad(model):
    group = _group(18, [3, 4])
    with float64_model():
        once, _ = _run(model, group, GRPOObjective(), "exact", 5, 4, 4)
        grpo_backward(model, group, GRPOObjective(), longstraw={"prefix_grad": "exact", "capture_chunk": 5})
    twice = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert relative_l2(twice, {n: 2 * g for n, g in once.items()}) <= TOL


@pytest.mark.parametrize("dtype,plain_factor", [(torch.float32, 2.0), (torch.bfloat16, 2.0)])
@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_lower_precision_within_twice_plain_error(mode, dtype, plain_factor):
    """In float32/bfloat16 the transaction may err against float64 by at most ~2x what the model's own
    same-precision computation of the same quantity errs by (plus a floor of 1e-6 for float32, where both errors
    are at rounding level and their ratio is noise)."""
    group = _group(26, [5, 4, 3])
    objective = GRPOObjective()
    reference_fn = cache_continuation_logprobs if mode == "detached" else full_sequence_logprobs
    reference_model = tiny_qwen3_5(dtype=torch.float64)
    low_model = tiny_qwen3_5(dtype=dtype)
    with float64_model():
        ref_grads, _ = _reference(reference_model, group, objective, reference_fn)
    mine, result = _run(low_model, group, objective, mode, 7, 4, 4)
    plain, _ = _reference(low_model, group, objective, reference_fn)
    plain_error = relative_l2({n: g.double() for n, g in plain.items()}, ref_grads)
    floor = 1e-6 if dtype == torch.float32 else 0.0
    assert relative_l2({n: g.double() for n, g in mine.items()}, ref_grads) <= plain_factor * plain_error + floor
    assert all(torch.isfinite(g).all() for g in mine.values())
    assert all(torch.isfinite(lp).all() for lp in result.logprobs)


@pytest.mark.parametrize("baseline", ["conventional", "per_member"])
def test_baselines_take_the_exact_gradient(model, baseline):
    """Both baselines are full-graph computations: their gradients are the exact ones."""
    from ds_longstraw.tools import baselines

    group = _group(21, [4, 2, 5], seed=9)
    objective = GRPOObjective(kl_coef=0.2)
    ref_model = tiny_qwen3_5(seed=3)
    with float64_model():
        ref_grads, (ref_loss, _) = _reference(model, group, objective, full_sequence_logprobs, ref_model=ref_model)
        grads, result = grads_of(model, lambda: baselines.BASELINES[baseline](model, group, objective,
                                                                              ref_model=ref_model))
    assert relative_l2(grads, ref_grads) <= TOL
    assert result.loss == pytest.approx(ref_loss, rel=1e-12)


@pytest.mark.parametrize("recompute", [True, False])
def test_prefix_block_splits_the_prefix_pass(model, recompute):
    """prefix_block < capture_chunk (and dividing neither the chunk nor the prompt): capture checkpoints the GDN
    carry every prefix_block tokens, the prefix pass recomputes one such segment at a time (with or without the
    per-layer recompute), and the gradients are still those of full-sequence autograd (same tolerance as
    test_matches_reference)."""
    group = _group(30, [4, 6], seed=3)
    objective = GRPOObjective()
    config = {"prefix_grad": "exact", "capture_chunk": 12, "prefix_block": 5, "page_tokens": 4, "replay_block": 3,
              "prefix_recompute": recompute, "prefix_keep_graph": False}  # a kept capture graph has no checkpoints
    with float64_model():
        ref_grads, (ref_loss, _) = _reference(model, group, objective, full_sequence_logprobs)
        grads, result = grads_of(model, lambda: grpo_backward(model, group, objective, longstraw=config))
        _, whole_chunks = grads_of(model, lambda: grpo_backward(
            model, group, objective, longstraw=dict(config, prefix_block=None)))
    assert relative_l2(grads, ref_grads) <= TOL
    assert result.loss == pytest.approx(ref_loss, rel=1e-12, abs=1e-12)
    # 29 captured tokens: segments start at 0, 5, ..., 25 (6 segments; the first starts from zeros, no checkpoint)
    # against chunks at 0, 12, 24 (3 chunks) without prefix_block
    per_boundary = whole_chunks.retained_bytes["carry_checkpoints"] // 2
    assert per_boundary > 0
    assert result.retained_bytes["carry_checkpoints"] == 5 * per_boundary


@pytest.mark.parametrize("case,prefix_block,kl_coef", [("chunk-and-page-do-not-divide", None, 0.0),
                                                       ("one-token-responses", 4, 0.0), ("G1", 3, 0.3)])
def test_kept_attention_is_exact_and_skips_the_prompt_attention(monkeypatch, case, prefix_block, kl_coef):
    """prefix_keep_attention: the prefix pass takes each segment's attention (out, lse) from capture instead of
    recomputing it. Chain: exact(kept) == full-sequence autograd (TOL, as test_matches_reference) and
    == exact(recomputed) to 1e-12 (the same float64 operations on the same values: 0 in practice). The prefix
    pass then computes no attention: the transaction runs as many attention forwards as detached mode does
    (capture + replay). The kept pages hold (H D + H) float64 values per captured token per attention layer."""
    from ds_longstraw.kernels.attention import partial as attention_module

    # an attention layer before the last one: a one-rank capture runs the last layer for its rows alone and keeps
    # none of its attention (test_last_layer_rows.py)
    model = tiny_qwen3_5(layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])
    prompt_len, response_lens, chunk, page, block, objective_kwargs = CASES[case]
    group = _group(prompt_len, response_lens)
    objective = GRPOObjective(kl_coef=kl_coef, **objective_kwargs)
    ref_model = tiny_qwen3_5(seed=2) if kl_coef else None
    # the prefix pass over every segment (a kept capture graph would leave it none: test_kept_graph.py)
    base = {"capture_chunk": chunk, "page_tokens": page, "replay_block": block, "prefix_block": prefix_block,
            "prefix_keep_graph": False}
    forward = attention_module._forward
    calls = []
    monkeypatch.setattr(attention_module, "_forward", lambda *a: calls.append(1) or forward(*a))

    def run(**config):
        calls.clear()
        grads, result = grads_of(model, lambda: grpo_backward(model, group, objective, longstraw={**base, **config},
                                                              ref_model=ref_model))
        return grads, result, len(calls)

    with float64_model():
        ref_grads, (ref_loss, _) = _reference(model, group, objective, full_sequence_logprobs, ref_model=ref_model)
        kept, result, kept_calls = run(prefix_grad="exact", prefix_keep_attention=True)
        recomputed, plain, recomputed_calls = run(prefix_grad="exact")
        _, _, detached_calls = run(prefix_grad="detached", prefix_block=None)
    assert relative_l2(kept, ref_grads) <= TOL
    assert result.loss == pytest.approx(ref_loss, rel=1e-12, abs=1e-12)
    assert relative_l2(kept, recomputed) <= 1e-12
    config = model.config
    attention_layers = config.layer_types[:-1].count("full_attention")  # but the last one's
    per_token = (config.num_attention_heads * config.head_dim + config.num_attention_heads) * 8
    assert result.retained_bytes["kept_attention_pages"] == (prompt_len - 1) * attention_layers * per_token
    assert plain.retained_bytes["kept_attention_pages"] == 0
    if prefix_block is None:  # same capture segments in both modes: the prefix pass adds no attention forward
        assert kept_calls == detached_calls < recomputed_calls
    else:
        assert kept_calls < recomputed_calls


@pytest.mark.parametrize("lora", [False, True])
def test_prefix_recompute_under_a_callers_backward(lora):
    """The per-layer recompute also runs when a caller back-propagates (the DeepSpeed engine passes engine.backward):
    with prefix_recompute each layer's forward runs once more per prefix segment (counted on one MLP), and the
    gradients equal full-sequence autograd (TOL) with and without it. lora: a peft policy, whose embedding output
    does not require grad (the re-entrant recompute must still reach the adapters of every layer)."""
    model = tiny_qwen3_5()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"],
                                                 init_lora_weights=False))
    group = _group(26, [3, 5], seed=4)
    objective = GRPOObjective()
    mlp = [m for name, m in model.named_modules() if name.endswith("layers.0.mlp")][0]
    calls = []
    mlp.register_forward_hook(lambda *_: calls.append(1))
    backwards = []

    def backward(loss):
        backwards.append(1)
        loss.backward()

    def run(recompute):
        calls.clear()
        config = {"prefix_grad": "exact", "capture_chunk": 12, "prefix_block": 5, "page_tokens": 4,
                  "replay_block": 3, "prefix_recompute": recompute, "prefix_keep_graph": False}
        grads, _ = grads_of(model, lambda: grpo_backward(model, group, objective, longstraw=config, backward=backward))
        return grads, len(calls)

    with float64_model():
        ref_grads, _ = _reference(model, group, objective, full_sequence_logprobs)
        recomputed, recomputed_calls = run(True)
        kept_graph, kept_graph_calls = run(False)
    assert backwards, "the caller's backward was not used"
    assert relative_l2(recomputed, ref_grads) <= TOL
    assert relative_l2(kept_graph, ref_grads) <= TOL
    assert recomputed_calls - kept_graph_calls == 5  # 25 captured tokens: 5 prefix segments, one more call each
    if lora:
        assert any("lora_A" in name for name in recomputed)


def test_prefix_block_is_validated():
    with pytest.raises(ValueError, match="prefix_block"):
        grpo_backward(tiny_qwen3_5(), _group(9, [2, 2]), longstraw={"prefix_grad": "exact", "prefix_block": 0})
