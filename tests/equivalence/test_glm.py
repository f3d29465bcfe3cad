"""The GRPO transaction on a glm_moe_dsa (GLM-5.x shape) model, on one rank, against transformers' own model.

Equivalence chains (float64 tiny model, glm_reference() making transformers compute in float64 with the canonical
top-k; tests/glm_models.py):
  grpo_backward(detached) == transformers prefill-then-continue: no-grad prefill of prompt[:-1] into its cache,
                             then each member continues with autograd on [prompt[-1], response[:-1]]
  grpo_backward(exact)    == transformers' full-sequence autograd of prompt + response for every member
  loss and per-member log-probs equal the references' in both modes; the indexer gets no gradient on either side.
  dsa_select == dsa_select_reference (one stable sort of the whole score matrix), for any key pieces and blocks
  sparse_latent_attention == sparse_latent_attention_reference (plain autograd), values and gradients
Tolerance: relative L2 <= 1e-8 over all parameter gradients (the contract's). Both sides compute the same functions in
float64 in different orders (absorbed attention over gathered rows vs transformers' expanded per-head K/V under an
index mask, chunks vs the whole sequence), which leaves ~1e-15; a wrong path (a missing gradient term, a shifted
position, a different selection, a stale page) shows up at 1e-4 or worse.

Coverage: index_topk 8 below every prompt (40-60 tokens: sparsity active), full and shared indexer layers, a dense
first layer, 6 experts top-2 with group-limited routing and a non-zero correction bias, prompts that are not a
multiple of the chunk or page size, G = 1, one-token responses, kl_coef > 0, host and NVMe tiers, a LoRA policy
(kv_b_proj adapted) with its adapters disabled as the reference, float32 / bfloat16 within 2x of transformers' own
error, and a model with one indexer head, whose scores tie at exactly 0, selecting the same positions in capture,
replay and the reference.
"""

import pytest
import torch
from glm_models import VOCAB, boundary_ties, glm_reference, reference_selections, tiny_glm_moe_dsa
from grads import grads_of, relative_l2
from models import cache_continuation_logprobs, full_sequence_logprobs
from reference import reference_step

from ds_longstraw import GRPOGroup, GRPOObjective, grpo_backward
from ds_longstraw.arch import adapter_for
from ds_longstraw.arch.glm_moe_dsa import GlmMoeDsaAdapter
from ds_longstraw.kernels.dsa import selection as dsa
from ds_longstraw.kernels.sparse_mla import attention as sparse_mla

TOL = 1e-8

CASES = {
    # name: (prompt length, response lengths, settings, objective kwargs)
    "chunk-and-page-do-not-divide": (47, [5, 3, 7], {"capture_chunk": 13, "page_tokens": 6, "replay_block": 4}, {}),
    "G1": (41, [6], {"capture_chunk": 9, "page_tokens": 4, "replay_block": 3}, {}),
    "one-token-responses": (44, [1, 1, 1], {"capture_chunk": 10, "page_tokens": 7, "replay_block": 2}, {}),
    "prefix-block-without-recompute": (
        52, [4, 6], {"capture_chunk": 16, "prefix_block": 7, "prefix_recompute": False, "page_tokens": 5,
                     "replay_block": 5}, {"loss_agg": "seq-mean-token-mean"}),
}


def _group(prompt_len, response_lens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB, (prompt_len,), generator=gen)
    responses = [torch.randint(0, VOCAB, (n,), generator=gen) for n in response_lens]
    if len(responses) == 1:  # one member's scaled advantage is 0: give an advantage so there is a gradient
        return GRPOGroup(prompt, responses, advantages=[0.7])
    return GRPOGroup(prompt, responses, rewards=torch.rand(len(responses), generator=gen).tolist())


def _run(model, group, objective, mode, longstraw, **kwargs):
    # "exact-graph": exact mode with the capture's graph kept where it fits (prefix_keep_graph "fits": these short
    # prompts' whole graph; grpo/kept_graph.py); "exact", the default, keeps none and recomputes every segment
    config = {"prefix_grad": mode.removesuffix("-graph"), **longstraw}
    if mode == "exact-graph":
        config["prefix_keep_graph"] = "fits"
    return grads_of(model, lambda: grpo_backward(model, group, objective, longstraw=config, **kwargs))


def _reference(model, group, objective, mode, ref_model=None):
    logprob_fn = cache_continuation_logprobs if mode == "detached" else full_sequence_logprobs
    return reference_step(model, group, objective.group_loss, logprob_fn, ref_model if objective.kl_coef > 0 else None)


def _assert_matches(model, group, objective, mode, longstraw, ref_model=None, **kwargs):
    """Run both sides under glm_reference() and compare gradients, loss, log-probs (and reference log-probs)."""
    with glm_reference():
        ref_grads, (ref_loss, ref_logps, ref_ref) = _reference(model, group, objective, mode, ref_model)
        grads, result = _run(model, group, objective, mode, longstraw, ref_model=ref_model, **kwargs)
    error = relative_l2(grads, ref_grads)
    assert error <= TOL, error
    assert set(grads) == set(ref_grads)
    assert not any(".indexer." in name for name in grads), "the indexer gets no gradient, as the model defines"
    assert result.loss == pytest.approx(ref_loss, rel=1e-12, abs=1e-12)
    for mine, ref in zip(result.logprobs, ref_logps, strict=True):
        torch.testing.assert_close(mine, ref.double(), rtol=0, atol=1e-11)
    if ref_ref is not None:
        for mine, ref in zip(result.ref_logprobs, ref_ref, strict=True):
            torch.testing.assert_close(mine, ref.double(), rtol=0, atol=1e-11)
    return result


@pytest.fixture(scope="module")
def model():
    return tiny_glm_moe_dsa()


def test_tiny_model_exercises_every_part(model):
    """The tiny model has what the tests claim to cover (guards the builder against silent config changes)."""
    config = model.config
    assert config.indexer_types == ["full", "shared", "full", "shared"]
    assert config.mlp_layer_types == ["dense", "sparse", "sparse", "sparse"]
    assert config.index_topk < min(prompt for prompt, *_ in CASES.values())
    assert config.n_group > 1 and config.topk_group < config.n_group  # group-limited routing
    assert config.n_routed_experts // config.n_group >= 2
    biases = [b for name, b in model.named_buffers() if name.endswith("e_score_correction_bias")]
    assert len(biases) == 3 and all(b.abs().min() > 0 for b in biases)
    adapter = adapter_for(model)
    assert isinstance(adapter, GlmMoeDsaAdapter)
    assert adapter.paged_layers == [0, 1, 2, 3] and adapter.carry_layers == []


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", ["detached", "exact", "exact-graph"])
def test_matches_transformers(model, case, mode):
    prompt_len, response_lens, longstraw, objective_kwargs = CASES[case]
    _assert_matches(model, _group(prompt_len, response_lens), GRPOObjective(**objective_kwargs), mode, longstraw)


@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_kl_to_separate_reference_model(model, mode):
    """kl_coef > 0: the reference policy is captured and scored first (its own selections), then freed."""
    ref_model = tiny_glm_moe_dsa(seed=7)
    result = _assert_matches(model, _group(45, [4, 6, 2], seed=3), GRPOObjective(kl_coef=0.3), mode,
                             {"capture_chunk": 11, "page_tokens": 4, "replay_block": 3}, ref_model=ref_model)
    assert result.ref_logprobs is not None
    assert not any(p.grad is not None for p in ref_model.parameters()), "the reference model must get no gradient"


def _tier(tier, path, monkeypatch):
    if tier == "cpu":
        return {"tier": "cpu", "staging_depth": 1}
    if tier == "nvme-aio":
        from ds_longstraw.offload import io_engine

        try:
            io_engine.load_aio()
        except RuntimeError as error:
            pytest.skip(f"DeepSpeed's aio op cannot be built here: {error}")
    else:  # as on a filesystem that refuses O_DIRECT
        monkeypatch.setattr("ds_longstraw.offload.nvme_pool.probe_direct_io", lambda directory: False)
    return {"tier": "nvme", "nvme_path": str(path), "staging_depth": 2, "aio": {"block_size": 4096, "queue_depth": 4}}


@pytest.mark.parametrize("mode,tier", [("exact", "cpu"), ("detached", "nvme-buffered"), ("exact", "nvme-aio"),
                                       ("exact-graph", "nvme-aio")])
def test_tiers(model, tmp_path, monkeypatch, mode, tier):
    """Pages (latent, rope key, indexer key) and exact mode's gradient pages on the host or in NVMe files. In exact
    mode the prompt pages' gradients reach them as the selected rows only (the sparse attention's row sinks:
    add_grad_rows), never as a dense page gradient (add_grad)."""
    longstraw = {"capture_chunk": 12, "page_tokens": 5, "replay_block": 3,
                "offload": _tier(tier, tmp_path, monkeypatch)}
    calls = _count_gradient_adds(monkeypatch)
    _assert_matches(model, _group(43, [3, 5], seed=4), GRPOObjective(), mode, longstraw)
    assert list(tmp_path.iterdir()) == []  # page files are removed
    assert calls["add_grad"] == 0
    if mode == "detached":
        assert calls["add_grad_rows"] == 0
    else:  # every layer's latent and rope key, in replay and in the prefix pass
        assert calls["add_grad_rows"] >= 2 * model.config.num_hidden_layers


def _count_gradient_adds(monkeypatch):
    """Counts the host and NVMe pools' gradient additions, dense (add_grad) and by rows (add_grad_rows): the real
    methods, wrapped."""
    from ds_longstraw.offload.tiered import TieredPagePool

    calls = {"add_grad": 0, "add_grad_rows": 0}
    for name in calls:
        real = getattr(TieredPagePool, name)

        def counted(self, *args, _real=real, _name=name):
            calls[_name] += 1
            return _real(self, *args)

        monkeypatch.setattr(TieredPagePool, name, counted)
    return calls


def test_exact_differs_from_detached(model):
    """The two modes must be distinguishable, or the tests above could not tell them apart."""
    group = _group(42, [5, 3])
    longstraw = {"capture_chunk": 10, "page_tokens": 4, "replay_block": 4}
    with glm_reference():
        detached, _ = _run(model, group, GRPOObjective(), "detached", longstraw)
        exact, _ = _run(model, group, GRPOObjective(), "exact", longstraw)
    assert relative_l2(detached, exact) > 1e-3


@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_lora_policy_with_adapters_disabled_as_reference(mode):
    """A peft LoRA policy on the family's default targets (LORA_TARGETS: kv_b_proj among them, which the absorbed
    attention reads by calling it on the identity), kl_coef > 0 against the same model with its adapters disabled:
    the adapters' gradients equal transformers' (relative L2 <= 1e-8; measured ~1e-15), kv_b_proj's included."""
    from ds_longstraw.models.lora import apply_lora

    policy = apply_lora(tiny_glm_moe_dsa(), r=2, alpha=4, seed=0)
    with torch.no_grad():  # peft starts B at zero, where A gets no gradient: make every adapter matter
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn_like(p) * 0.05)
    group, objective = _group(45, [4, 3]), GRPOObjective(kl_coef=0.2)
    logprob_fn = cache_continuation_logprobs if mode == "detached" else full_sequence_logprobs

    def reference():
        logps = logprob_fn(policy, group.prompt_ids, group.response_ids)
        with torch.no_grad(), policy.disable_adapter():
            ref = logprob_fn(policy, group.prompt_ids, group.response_ids)
        objective.group_loss(group, logps, ref).backward()

    with glm_reference():
        ref_grads, _ = grads_of(policy, reference)
        grads, _ = _run(policy, group, objective, mode, {"capture_chunk": 11, "page_tokens": 4, "replay_block": 3})
    assert relative_l2(grads, ref_grads) <= TOL
    assert any("kv_b_proj.lora_A" in name and grad.abs().max() > 0 for name, grad in grads.items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_lower_precision_within_twice_plain_error(model, mode, dtype):
    """In float32 / bfloat16 (the model's own definitions: float32 norms, router and indexer scores, torch.topk) the
    transaction errs against the float64 reference by at most 2x what transformers' own same-precision computation
    of the same quantity errs by, plus a floor of 1e-6 where both are at float32 rounding level (measured: float32
    4e-7 against transformers' 2e-2, whose float32 topk breaks ties its own way; bfloat16 0.09-0.10 against
    0.09-0.11)."""
    import copy

    group = _group(47, [5, 3, 4])
    objective = GRPOObjective()
    low = copy.deepcopy(model).to(dtype)
    with glm_reference():
        ref_grads, _ = _reference(model, group, objective, mode)
    mine, result = _run(low, group, objective, mode, {"capture_chunk": 13, "page_tokens": 6, "replay_block": 4})
    plain, _ = _reference(low, group, objective, mode)
    plain_error = relative_l2({n: g.double() for n, g in plain.items()}, ref_grads)
    floor = 1e-6 if dtype == torch.float32 else 0.0
    assert relative_l2({n: g.double() for n, g in mine.items()}, ref_grads) <= 2.0 * plain_error + floor
    assert all(torch.isfinite(g).all() for g in mine.values())
    assert all(torch.isfinite(lp).all() for lp in result.logprobs)


# -- exact zero-score ties: the same selection everywhere ---------------------------------------------------------
@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_zero_score_ties_select_alike_in_capture_replay_and_reference(monkeypatch, mode):
    """One indexer head: its ReLU scores are exactly 0 for many keys, and the K-th and (K+1)-th best tie at the
    boundary for many queries, so the tie-break alone decides the selection. Capture (and exact mode's prefix pass),
    replay and transformers' full forward with the canonical top-k select the same sets at every position of every
    full indexer layer, and the gradients match."""
    model = tiny_glm_moe_dsa(index_n_heads=1, seed=1)
    group = _group(50, [6, 4], seed=1)
    longstraw = {"capture_chunk": 9, "page_tokens": 4, "replay_block": 3}
    length = group.prompt_ids.numel() - 1

    seen = []  # (phase, layer, first position, positions, valid) of every full indexer layer's selection
    forward = GlmMoeDsaAdapter.attention_forward

    def recording(self, index, module, h, cos, sin, start, past, selection, remote=None, selected=None):
        result = forward(self, index, module, h, cos, sin, start, past, selection, remote, selected)
        if module.indexer is not None:
            phase = "replay" if start >= length else "prompt"
            seen.append((phase, index, start, *(t.clone() for t in result[2])))
        return result

    monkeypatch.setattr(GlmMoeDsaAdapter, "attention_forward", recording)
    _assert_matches(model, group, GRPOObjective(), mode, longstraw)

    references = []
    for response in group.response_ids:
        record = []
        with glm_reference(record), torch.no_grad():
            model(torch.cat([group.prompt_ids, response]).unsqueeze(0), use_cache=False)
        references.append(reference_selections(record))
        assert boundary_ties(record) >= 10, "test setup: the tie-break must decide many selections"

    member = -1
    checked = {"prompt": 0, "replay": 0}
    for phase, layer, start, positions, valid in seen:
        if phase == "replay" and start == length and layer == 0:  # a member's first replay block
            member += 1
        reference = references[max(member, 0)]  # prompt positions: the same in every member's sequence
        for row in range(positions.shape[0]):
            mine = set(positions[row][valid[row]].tolist())
            assert mine == reference[(layer, start + row)], (phase, layer, start + row)
            checked[phase] += 1
    assert member == group.size - 1
    assert checked["prompt"] >= 2 * length and checked["replay"] == 2 * sum(r.numel() for r in group.response_ids)


def test_prefix_recompute_reuses_the_forward_selection(model, monkeypatch):
    """A prefix-pass segment with prefix_recompute selects once per full indexer layer (its forward); the layers'
    recompute in backward reuses those selections, and every gradient (parameters, the past's pages) equals the
    segment's plain autograd (prefix_recompute off, which selects once too). Float64, the same functions in the same
    order: ~1e-16, asserted at 1e-12; a recompute that selected differently would move whole attention rows (>1e-3)."""
    from call_counts import counting

    from ds_longstraw.kernels import dsa as dsa_package

    adapter = GlmMoeDsaAdapter(model)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (50,), generator=gen)
    start = 30  # the past: the rows of positions 0 .. 29, with gradients
    with torch.no_grad():
        past_out = adapter.forward_segment(ids[:start], 0, {}, None)
    full = sum(layer.self_attn.indexer is not None for layer in adapter.layers)
    results = []
    for recompute in (True, False):
        past = {layer: [tuple(t.detach().clone().requires_grad_(t.is_floating_point() and n < 2)
                              for n, t in enumerate(rows))] for layer, rows in past_out.rows.items()}
        counts = counting(monkeypatch, dsa_package, ["dsa_select"])
        with glm_reference(), torch.enable_grad():
            out = adapter.forward_segment(ids[start:], start, {}, past, prefix_recompute=recompute)
            assert counts["dsa_select"] == full
            loss = out.hidden.pow(2).sum() + sum(rows[0].sum() for rows in out.rows.values())
            model.zero_grad(set_to_none=True)
            loss.backward()  # the re-entrant recompute takes .backward() only (not autograd.grad)
        assert counts["dsa_select"] == full, "the recompute in backward selects nothing again"
        leaves = [t for rows in past.values() for t in rows[0] if t.requires_grad]
        results.append([p.grad for p in model.parameters()] + [t.grad for t in leaves])
    for mine, plain in zip(*results, strict=True):
        assert (mine is None) == (plain is None)
        if mine is not None:
            torch.testing.assert_close(mine, plain, rtol=0, atol=1e-12)


@pytest.mark.parametrize("case,tier", [("chunk-and-page-do-not-divide", "cpu"),
                                       ("prefix-block-without-recompute", "cpu"), ("G1", "kept-on-nvme")])
def test_kept_selection_is_exact_and_the_prefix_pass_selects_nothing(model, tmp_path, monkeypatch, case, tier):
    """prefix_keep_attention "auto" (the default; on one rank it keeps for this family): capture keeps each full
    indexer layer's selection (int32 codes, index_topk per token) and the prefix pass attends it instead of scoring
    the prompt's keys again; prefix_keep_attention false selects again. Chain: exact(kept) == transformers'
    full-sequence autograd (TOL, as test_matches_transformers) and == exact(selected again) to 1e-12 (the same
    float64 operations on the same selection: 0 in practice; a stale or shifted kept selection moves whole attention
    rows, >1e-3). The prefix pass then selects nothing: the run without kept selections selects once more per full
    indexer layer and prefix-pass segment, exactly. The kept pages hold 4 index_topk bytes per captured token per
    full indexer layer, on the pages' tier or a tier of their own (offload.kept_attention_tier), whose files go."""
    from call_counts import counting

    from ds_longstraw.kernels import dsa as dsa_package

    prompt_len, response_lens, longstraw, objective_kwargs = CASES[case]
    group, objective = _group(prompt_len, response_lens), GRPOObjective(**objective_kwargs)
    offload = ({"tier": "cpu", "kept_attention_tier": "nvme", "nvme_path": str(tmp_path)} if tier == "kept-on-nvme"
               else _tier(tier, tmp_path, monkeypatch))
    kept_config = {**longstraw, "offload": offload}
    result = _assert_matches(model, group, objective, "exact", kept_config)
    counts = counting(monkeypatch, dsa_package, ["dsa_select"])
    calls = {}
    with glm_reference():
        for name, mode, config in (("kept", "exact", kept_config),
                                   ("again", "exact", {**longstraw, "prefix_keep_attention": False})):
            counts["dsa_select"] = 0
            calls[name] = _run(model, group, objective, mode, config), counts["dsa_select"]
    (kept, kept_result), kept_calls = calls["kept"]
    (again, _), again_calls = calls["again"]
    assert relative_l2(kept, again) <= 1e-12
    assert kept_result.loss == result.loss
    config = model.config
    full = config.indexer_types.count("full")
    segment = min(longstraw["capture_chunk"], longstraw.get("prefix_block") or longstraw["capture_chunk"])
    segments = -(-(prompt_len - 1) // segment)
    assert again_calls - kept_calls == full * segments
    assert result.retained_bytes["kept_attention_pages"] == (prompt_len - 1) * full * config.index_topk * 4
    assert list(tmp_path.iterdir()) == []  # the kept pages' files are removed


# -- the family math against its plain references -----------------------------------------------------------------
def _pieces(lengths, width, gen, zero_rows=0.0):
    pieces = []
    for n in lengths:
        piece = torch.randn(n, width, generator=gen, dtype=torch.float64)
        if zero_rows:
            piece[torch.rand(n, generator=gen) < zero_rows] = 0.0
        pieces.append(piece)
    return pieces


@pytest.mark.parametrize("start,lengths", [(0, [11]), (13, [13, 11]), (29, [7, 0, 15, 3, 11])])
def test_selection_matches_the_plain_sort(monkeypatch, start, lengths):
    """Blocked selection (key pieces split further into blocks of 4, query blocks of 2) == one stable sort of the
    whole score matrix, position for position, with many exact ties (keys of zeros and a one-head indexer)."""
    monkeypatch.setattr(dsa, "BLOCK_ELEMENTS", 2 * 4)
    gen = torch.Generator().manual_seed(start)
    keys = _pieces(lengths, 6, gen, zero_rows=0.3)
    tokens = sum(lengths) - start
    for heads in (1, 3):
        q = torch.randn(tokens, heads, 6, generator=gen, dtype=torch.float64)
        weights = torch.randn(tokens, heads, generator=gen, dtype=torch.float64)
        for topk in (5, 64):
            mine = dsa.dsa_select(q, weights, keys, start, topk, 0.4, key_block=4)
            plain = dsa.dsa_select_reference(q, weights, keys, start, topk, 0.4)
            assert torch.equal(mine[1], plain[1])
            assert torch.equal(mine[0], plain[0])
            assert mine[1].sum(-1).tolist() == [min(topk, start + t + 1) for t in range(tokens)]


def test_sparse_latent_attention_matches_plain_autograd(monkeypatch):
    """Forward and backward walk query blocks of 3 (BLOCK_ELEMENTS) over pieces one of which is empty; the
    gradients of the queries and of every piece equal plain autograd through gathered rows (float64, ~1e-16)."""
    monkeypatch.setattr(sparse_mla, "BLOCK_ELEMENTS", 3 * 5 * (6 + 4))
    monkeypatch.setattr(dsa, "BLOCK_ELEMENTS", 3 * 5 * (6 + 4))
    gen = torch.Generator().manual_seed(0)
    lengths, tokens, heads, k = [9, 0, 6, 8], 8, 3, 5
    start = sum(lengths) - tokens
    latents = [p.requires_grad_() for p in _pieces(lengths, 6, gen)]
    ropes = [p.requires_grad_() for p in _pieces(lengths, 4, gen)]
    q_lat = torch.randn(tokens, heads, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    q_rope = torch.randn(tokens, heads, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    index_q = torch.randn(tokens, 2, 5, generator=gen, dtype=torch.float64)
    index_keys = _pieces(lengths, 5, gen)
    positions, valid = dsa.dsa_select(index_q, torch.ones(tokens, 2, dtype=torch.float64), index_keys, start, k, 1.0)
    d_out = torch.randn(tokens, heads, 6, generator=gen, dtype=torch.float64)
    inputs = [q_lat, q_rope, *latents, *ropes]
    results = []
    for fn in (sparse_mla.sparse_latent_attention, sparse_mla.sparse_latent_attention_reference):
        out = fn(q_lat, q_rope, latents, ropes, positions, valid, 0.7)
        grads = torch.autograd.grad(out, inputs, d_out, allow_unused=True)
        results.append((out, grads))
    (out, grads), (ref_out, ref_grads) = results
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-13)
    for grad, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, torch.zeros_like(grad) if ref is None else ref, rtol=0, atol=1e-13)


def test_rows_below_the_offset_are_left_out_exactly():
    """sparse_latent_attention with an offset (context parallelism: the selected rows below it lie on other ranks)
    equals the same call over the rows placed at their positions behind filler rows, with the slots below the offset
    unselected: values, lse and every gradient. The offset call compacts each query's slots to the rows that are
    here (most queries have a few of K); a slot moved to the wrong row or dropped changes whole rows (>1e-2). Float64,
    the same sums in another order: ~1e-16, asserted at 1e-13."""
    gen = torch.Generator().manual_seed(11)
    offset, lengths, heads, k = 37, [5, 9], 3, 12
    tokens = sum(lengths)
    latents = [p.requires_grad_() for p in _pieces(lengths, 6, gen)]
    ropes = [p.requires_grad_() for p in _pieces(lengths, 4, gen)]
    q_lat = torch.randn(tokens, heads, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    q_rope = torch.randn(tokens, heads, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    # each query's K selected positions among every earlier one (most below the offset), canonical or not
    positions = torch.stack([torch.randperm(offset + t + 1, generator=gen)[:k] for t in range(tokens)])
    valid = torch.rand(tokens, k, generator=gen) < 0.9
    d_out = torch.randn(tokens, heads, 6, generator=gen, dtype=torch.float64)
    d_lse = torch.randn(tokens, heads, generator=gen, dtype=torch.float64)
    filler_lat, filler_rope = torch.randn(offset, 6, dtype=torch.float64), torch.randn(offset, 4, dtype=torch.float64)
    inputs = [q_lat, q_rope, *latents, *ropes]
    results = []
    for placed in (False, True):
        if placed:
            out, lse = sparse_mla.sparse_latent_attention(q_lat, q_rope, [filler_lat, *latents], [filler_rope, *ropes],
                                                          positions, valid & (positions >= offset), 0.7, with_lse=True)
        else:
            out, lse = sparse_mla.sparse_latent_attention(q_lat, q_rope, latents, ropes, positions, valid, 0.7,
                                                          offset=offset, with_lse=True)
        here = torch.isfinite(lse)  # a query with no row here: lse -inf, no gradient through it
        grads = torch.autograd.grad([out, lse[here]], inputs, [d_out, d_lse[here]], allow_unused=True)
        results.append((out, lse, grads))
    (out, lse, grads), (ref_out, ref_lse, ref_grads) = results
    assert ((valid & (positions >= offset)).sum(-1) < k).all() and torch.isfinite(lse).any()
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-13)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-13)
    for grad, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref, rtol=0, atol=1e-13)


def test_unsupported_paths_say_so(model):
    adapter = adapter_for(model)
    ids = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="layer 1: a kept selection for a shared indexer layer"):
        adapter.forward_segment(ids, 0, {}, {}, known_attention={1: None})
    with pytest.raises(ValueError, match="past covers 0 positions from 0, the segment starts at 5"):
        adapter.forward_segment(ids, 5, {}, {})
