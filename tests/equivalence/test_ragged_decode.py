"""The batched decode over samples at different lengths and non-consecutive slots (a multi-turn rollout; a one-turn
rollout after samples stop), against the per-sample path (one call per sample over exactly its rows: the plain
reference).

Equivalence chains (float64):
  OwnRows.batch_rows: the running slots from the first to the last as one OwnBatch, W = the longest count; each
      running slot's rows past its own count zeroed once (from its first unwritten row), the stopped slots' rows
      never touched (they stay NaN)
  arch/decode.own_partial(OwnBatch), every form (two batched products over the rows in place, for few query heads
      per kv head on CPU; the fused CPU kernel with the mask as a bias; the dense einsum used elsewhere), and
      own_partial_slots (the per-sample path's two products)
      == own_partial_each(each sample's rows, partial_attention): out and lse, at one
      length, at different lengths, with stopped slots before, between and after the running ones; the buffers are
      NaN past what was written, so a masked row that still reaches a running sample's sum shows up
  generate(environment, batched decode) takes the batched call at every attention layer of every step (qwen3_5:
      own_partial; glm_moe_dsa: _own_partial_batched and _own_candidates_batched) and none per sample, while its
      samples are at different lengths and its slots not consecutive; with batch_rows refused (the per-sample path)
      it gives the same tokens and masks, log-probs within TOL
Tolerance: both sides are float64 and differ only in the order of their sums (a dense masked einsum over W rows
or the fused kernel over W rows with a -inf bias, against partial_attention over T_g rows). Measured here:
out within 6e-16 of its largest entry, lse within 2e-16 of its largest, log-probs within 9e-16 (absolute). TOL =
1e-12 leaves room for other BLAS blockings and still catches a wrong row, length or mask (1e-2 or worse).
"""

import pytest
import torch
from call_counts import counting
from rollout_families import FAMILIES, family_prompt, poison_rows
from turn_envs import ToolTable

import ds_longstraw.arch.decode as decode
import ds_longstraw.arch.glm_moe_dsa as glm
import ds_longstraw.arch.qwen3_5 as qwen
from ds_longstraw import generate
from ds_longstraw.arch.decode import OwnRows

TOL = 1e-12
STOPS = tuple(range(2, 97, 5))  # a fifth of the vocabulary ends an action (as test_rollout_turns.py)


def _poisoned(part, shape):
    return part.new_full(shape, float("nan"))


def _own_rows(counts, streams, seed, slots):
    """OwnRows of len(counts) slots, NaN past what is written: the running `slots` at length counts[s] - 1 with this
    step's row written (extra=1 reads counts[s]), the others (stopped) at counts[s]; streams: each stream's
    trailing shape."""
    generator = torch.Generator().manual_seed(seed)
    own = OwnRows(len(counts), max(counts) + 3, _poisoned)
    for slot, count in enumerate(counts):
        earlier = count - 1 if slot in slots else count
        own.extend(0, slot, tuple(torch.randn(earlier, *shape, generator=generator, dtype=torch.float64)
                                  for shape in streams))
        own.advance(slot, earlier)
    own.write(0, slots, tuple(torch.randn(len(slots), *shape, generator=generator, dtype=torch.float64)
                              for shape in streams))
    return own


# (each slot's count, the running slots): one length, different lengths, stopped slots before, between and after
CASES = {"G1-first-step": ([1], [0]), "G3-T7": ([7] * 3, [0, 1, 2]), "G3-ragged": ([7, 2, 12], [0, 1, 2]),
         "G3-ragged-first-step": ([1, 5, 1], [0, 1, 2]), "G5-stopped-between": ([9, 4, 13, 1, 6], [0, 2, 4]),
         "G4-stopped-around": ([3, 8, 5, 11], [1, 2]), "G1-of-3": ([2, 6, 9], [1])}


@pytest.mark.parametrize("counts,slots", CASES.values(), ids=CASES.keys())
def test_batch_rows_zero_only_the_running_slots_tails(counts, slots):
    own = _own_rows(counts, ((2, 4), (2, 4)), seed=1, slots=slots)
    batch = own.batch_rows(0, slots, extra=1)
    first, last = min(slots), max(slots)
    width = max(counts[s] for s in slots)
    assert batch.rows[0].shape[:2] == (last + 1 - first, width)
    assert (batch.picks_G is None) == (slots == list(range(first, last + 1)))
    if batch.picks_G is not None:
        assert batch.picks_G.tolist() == [s - first for s in slots]
    ragged = len({counts[s] for s in slots}) > 1
    assert (batch.lengths_S is None) == (not ragged)
    for slot in range(len(counts)):
        k_TKD = own.buffers[0][0][slot]
        if slot in slots:
            assert not k_TKD[:width].isnan().any() and (k_TKD[counts[slot]: width] == 0).all()
            assert k_TKD[max(width, counts[slot]):].isnan().all()
            assert own.filled[0][slot] == width
            if batch.lengths_S is not None:
                assert int(batch.lengths_S[slot - first]) == counts[slot]
        else:  # a stopped slot: read (its result dropped), never written
            assert k_TKD[counts[slot]:].isnan().all() and own.filled[0][slot] == counts[slot]
    zeroed = [own.filled[0][s] for s in range(len(counts))]
    own.batch_rows(0, slots, extra=1)
    assert [own.filled[0][s] for s in range(len(counts))] == zeroed  # once


def _dense(q_GHD, own, scale):
    out_SHD, lse_SH = decode._own_partial_dense(own.spread(q_GHD, 0.0), own, scale)
    return own.pick(out_SHD), own.pick(lse_SH)


@pytest.mark.parametrize("form", ["gemm-cpu", "fused-cpu", "dense"])
@pytest.mark.parametrize("counts,slots", CASES.values(), ids=CASES.keys())
def test_own_partial_equals_each(counts, slots, form, monkeypatch):
    heads, kv_heads, dim = 6, 2, 8
    own = _own_rows(counts, ((kv_heads, dim), (kv_heads, dim)), seed=sum(counts), slots=slots)
    q_GHD = torch.randn(len(slots), heads, dim, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    if form == "fused-cpu":  # 3 query heads per kv head take the two products unless the limit is below them
        monkeypatch.setattr(decode, "GEMM_QUERY_HEADS", 0)
    calls, real = [], decode._own_partial_gemm
    monkeypatch.setattr(decode, "_own_partial_gemm", lambda *args: calls.append(1) or real(*args))
    batched = _dense if form == "dense" else decode.own_partial
    out, lse = batched(q_GHD, own.batch_rows(0, slots, extra=1), 0.35)
    assert bool(calls) == (form == "gemm-cpu")
    want_out, want_lse = decode.own_partial_each(q_GHD, [own.rows(0, slot, extra=1) for slot in slots], 0.35)
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=TOL * float(want_lse.abs().max()))
    torch.testing.assert_close(out, want_out, rtol=0, atol=TOL * float(want_out.abs().max()))


@pytest.mark.parametrize("counts,slots", CASES.values(), ids=CASES.keys())
def test_own_partial_slots_equals_each(counts, slots):
    """The per-sample path's fast form (each sample's rows through the two products) == the reference."""
    heads, kv_heads, dim = 4, 2, 8
    own = _own_rows(counts, ((kv_heads, dim), (kv_heads, dim)), seed=sum(counts) + 1, slots=slots)
    q_GHD = torch.randn(len(slots), heads, dim, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    rows = [own.rows(0, slot, extra=1) for slot in slots]
    out, lse = decode.own_partial_slots(q_GHD, rows, 0.35)
    want_out, want_lse = decode.own_partial_each(q_GHD, rows, 0.35)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=TOL * float(want_lse.abs().max()))
    torch.testing.assert_close(out, want_out, rtol=0, atol=TOL * float(want_out.abs().max()))


# per family: the module whose calls are counted, the batched and per-sample calls, and how many of each per step
PATHS = {
    "qwen3_5": (decode, ["own_partial"], ["own_partial_slots"], qwen.Qwen35Adapter,
                lambda model: sum(kind == "full_attention" for kind in model.config.layer_types)),
    "glm_moe_dsa": (glm, ["_own_partial_batched", "_own_candidates_batched"],
                    ["_own_partial_each", "_own_candidates_each"], glm.GlmMoeDsaAdapter, None),
}


@pytest.fixture(scope="module")
def models():
    return {name: family["build"]() for name, family in FAMILIES.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_multi_turn_takes_the_batched_path_and_equals_each(models, family, monkeypatch):
    """G = 5, 30 tokens, sampled with eos ids among the draws and observations of 0 to 9 tokens: the samples sit
    at different lengths and leave the batch at different steps (slots not consecutive). Every attention layer of
    every decode step takes the batched calls and none per sample; with batch_rows refused the per-sample calls
    run instead and give the same tokens, masks and log-probs."""
    poison_rows(monkeypatch)
    model, prompt = models[family], family_prompt(family, seed=4)
    module, batched_names, each_names, adapter, attention_layers = PATHS[family]
    per_step = (attention_layers(model) if attention_layers else model.config.num_hidden_layers)
    steps = []
    real_step = adapter.decode_step

    def step(self, ids_G, position, carry, past, own, remote_attention=None, slots=None):
        steps.append(([own.lengths[s] for s in slots], list(slots)))
        return real_step(self, ids_G, position, carry, past, own, remote_attention, slots)

    monkeypatch.setattr(adapter, "decode_step", step)
    counts = counting(monkeypatch, module, batched_names + each_names)
    config, sampling = FAMILIES[family]["longstraw"], dict(temperature=0.9, top_p=0.95, seed=3,
                                                           eos_token_id=[0, 45, 90])
    with FAMILIES[family]["reference"]():
        batched = generate(model, prompt, 5, 30, longstraw=config, environment=ToolTable(STOPS), **sampling)
    assert any(len(set(lengths)) > 1 for lengths, _ in steps)  # samples at different lengths
    assert any(slots != list(range(slots[0], slots[0] + len(slots))) for _, slots in steps)  # slots left between
    want = {"_own_candidates_batched": len(steps) * 2} if family == "glm_moe_dsa" else {}
    want = {name: want.get(name, len(steps) * per_step) for name in batched_names} | dict.fromkeys(each_names, 0)
    assert counts == want

    steps.clear()
    counts.update(dict.fromkeys(counts, 0))
    monkeypatch.setattr(OwnRows, "batch_rows", lambda self, layer, slots, extra=0: None)
    with FAMILIES[family]["reference"]():
        each = generate(model, prompt, 5, 30, longstraw=config, environment=ToolTable(STOPS), **sampling)
    assert all(counts[name] == 0 for name in batched_names) and all(counts[name] > 0 for name in each_names)
    assert batched.turns == each.turns and max(batched.turns) >= 2 and batched.finished == each.finished
    for a, b in zip(batched.response_ids, each.response_ids, strict=True):
        assert torch.equal(a, b), (a.tolist(), b.tolist())
    for a, b in zip(batched.response_masks, each.response_masks, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(batched.logprobs, each.logprobs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=TOL)


@pytest.mark.parametrize("counts,slots,batched", [
    ([700, 340, 700], [0, 1, 2], True),  # 360 rows of padding, under 2 x 300
    ([700, 90, 700], [0, 1, 2], False),  # 610 rows: the per-sample calls are cheaper
    ([700, 650, 700], [0, 2], False),  # a stopped slot between: its 700 rows read for nothing
], ids=["padding-under-the-limit", "padding-over-the-limit", "stopped-slot-over-the-limit"])
def test_batch_rows_refuses_where_the_padding_costs_more_than_the_calls(counts, slots, batched):
    """On CPU a batch reads at most PADDING_ROWS_PER_CALL rows for nothing per per-sample call it saves; past that
    batch_rows refuses (None) and zeroes nothing."""
    own = _own_rows(counts, ((1, 2),), seed=2, slots=slots)
    filled = list(own.filled[0])
    assert decode.PADDING_ROWS_PER_CALL["cpu"] == 300
    assert (own.batch_rows(0, slots, extra=1) is not None) == batched
    if not batched:
        assert own.filled[0] == filled
