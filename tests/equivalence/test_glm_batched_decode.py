"""glm_moe_dsa's decode over each sample's own rows: the batched path (one call over the running samples' slots,
OwnRows.batch_rows: samples at different lengths padded to the longest and masked, stopped slots between running
ones computed and dropped) against the per-sample path (one call per sample, the plain reference).

Equivalence chains (float64):
  _own_candidates_batched(OwnBatch) == _own_candidates_each(each sample's [T_g, D]): scores and positions
  _own_partial_batched(OwnBatch) == _own_partial_each(each sample's rows): o_lat and lse, for
      selections mixing prompt positions, own positions and invalid slots, a sample that selected none of its own
      rows included (its partial (0, -inf)); the slots' rows past their counts are NaN (OwnRows' poisoned
      buffers): a read of an unwritten row that is not zeroed first shows up
  both at one length (a one-turn rollout), at different lengths, and with stopped slots before, between and after
      the running ones (their rows past their counts stay NaN: a stopped slot's result must be dropped)
  generate(one turn, batched path) == generate(one turn, OwnRows.batch_rows refused: the per-sample path): the same
      tokens, log-probs within 1e-12; and the one-turn generate takes the batched path at every layer of every step
Tolerance: both sides are float64 and differ only in the order of their sums (a dense masked sum over all T own
rows against a sum over the gathered selected ones; one batched matmul against G). Measured here: o_lat within
6e-16 of its largest entry (element-wise up to 5e-13 relative, on entries that nearly cancel: hence a tolerance
scaled by the largest entry), lse and scores within 1e-15 relative, log-probs within 2e-16. TOL = 1e-12 leaves room
for other BLAS blockings and still catches a wrong row, position or mask (1e-2 or worse).
"""

import pytest
import torch
from call_counts import counting
from glm_models import glm_reference, tiny_glm_moe_dsa
from rollout_families import FAMILIES, family_prompt, poison_rows

import ds_longstraw.arch.glm_moe_dsa as glm
from ds_longstraw import generate
from ds_longstraw.arch.decode import OwnRows

TOL = 1e-12


def _poisoned(part, shape):
    return part.new_full(shape, float("nan"))


def _own_rows(counts, streams, seed, slots=None):
    """OwnRows of len(counts) slots, NaN past what is written; the running `slots` (None: all) at length
    counts[s] - 1 with this step's row written (extra=1 reads counts[s]), the others (stopped) at counts[s];
    streams: the last dim of each stream. Returns (own, the OwnBatch, each running slot's views)."""
    generator = torch.Generator().manual_seed(seed)
    slots = list(range(len(counts))) if slots is None else slots
    own = OwnRows(len(counts), max(counts) + 3, _poisoned)
    for slot, count in enumerate(counts):
        earlier = count - 1 if slot in slots else count
        own.extend(0, slot, tuple(torch.randn(earlier, width, generator=generator, dtype=torch.float64)
                                  for width in streams))
        own.advance(slot, earlier)
    own.write(0, slots, tuple(torch.randn(len(slots), width, generator=generator, dtype=torch.float64)
                              for width in streams))
    batch = own.batch_rows(0, slots, extra=1)
    assert batch is not None and batch.rows[0].shape[:2] == (max(slots) + 1 - min(slots),
                                                           max(counts[s] for s in slots))
    return own, batch, [own.rows(0, slot, extra=1) for slot in slots]


def _selection(counts, first_own, width, seed):
    """(positions, valid) [G, width] in no particular order (a canonical selection is score-ordered): distinct
    positions, about half of a sample's own ones (this step's always; as many as fit) and prompt ones below
    first_own[g], every fifth slot invalid; sample 0 (when there are several) selects prompt positions only."""
    generator = torch.Generator().manual_seed(seed)
    positions, valid, groups = [], [], len(counts)
    for g, rows in enumerate(counts):
        own = torch.arange(first_own[g], first_own[g] + rows)
        own = torch.cat([own[-1:], own[:-1][torch.rand(rows - 1, generator=generator) > 0.5]])
        if g == 0 and groups > 1:
            own = own[:0]
        prompt = torch.randperm(first_own[g], generator=generator)[: max(0, width - own.numel())]
        picked = torch.cat([own, prompt])[:width][torch.randperm(width, generator=generator)]
        ok = torch.arange(width) % 5 != 4
        positions.append(torch.where(ok, picked, torch.zeros_like(picked)))
        valid.append(ok)
    return torch.stack(positions), torch.stack(valid)


# (each slot's count, the running slots (None: all)): one length, then different lengths, then stopped slots before,
# between and after the running ones (a one-turn rollout after samples stop; a multi-turn one)
CASES = {"G1-first-step": ([1], None), "G1-T9": ([9], None), "G3-first-step": ([1] * 3, None),
         "G3-T7": ([7] * 3, None), "G5-T13": ([13] * 5, None), "G3-ragged": ([7, 2, 12], None),
         "G3-ragged-first-step": ([1, 5, 1], None), "G5-stopped-between": ([9, 4, 13, 1, 6], [0, 2, 4]),
         "G4-stopped-around": ([3, 8, 5, 11], [1, 2]), "G1-of-3": ([2, 6, 9], [1])}


@pytest.mark.parametrize("narrow", [False, True], ids=["all-rows", "gathered"])
@pytest.mark.parametrize("counts,slots", CASES.values(), ids=CASES.keys())
def test_own_partial_batched_equals_each(counts, slots, narrow):
    """all-rows: the selection wider than the own rows (every own row read, the unselected masked); gathered: a
    selection of 4 slots, narrower than the longest own rows (once they pass 4), the selected rows gathered."""
    heads, rank, rope = 3, 24, 8
    own, batch, each = _own_rows(counts, (rank, rope, 16), seed=sum(counts), slots=slots)
    running = [rows_g[0].shape[0] for rows_g in each]
    groups = len(running)
    first_own = [45 + 2 * g for g in range(groups)]  # positions may differ even at one length
    selection = _selection(running, first_own, width=4 if narrow else max(11, max(running) + 1), seed=groups)
    generator = torch.Generator().manual_seed(7)
    q_lat = torch.randn(groups, heads, rank, generator=generator, dtype=torch.float64)
    q_rope = torch.randn(groups, heads, rope, generator=generator, dtype=torch.float64)
    out, lse = glm._own_partial_batched(q_lat, q_rope, batch, first_own, selection, 0.3)
    want_out, want_lse = glm._own_partial_each(q_lat, q_rope, each, first_own, selection, 0.3)
    assert not out.isnan().any()
    torch.testing.assert_close(lse, want_lse, rtol=TOL, atol=0)
    torch.testing.assert_close(out, want_out, rtol=0, atol=TOL * float(want_out.abs().max()))
    if groups > 1:  # sample 0 selected only prompt rows: no own partial
        assert torch.isinf(lse[0]).all() and (out[0] == 0).all()
        assert torch.isfinite(lse[1:]).any()


@pytest.mark.parametrize("counts,slots", CASES.values(), ids=CASES.keys())
def test_own_candidates_batched_equal_each(counts, slots):
    indexer_heads, dim = 3, 16
    _, batch, each = _own_rows(counts, (24, 8, dim), seed=sum(counts) + 1, slots=slots)
    groups = len(each)
    first_own = [45 + g for g in range(groups)]
    generator = torch.Generator().manual_seed(5)
    query = torch.randn(groups, indexer_heads, dim, generator=generator, dtype=torch.float64)
    weights = torch.randn(groups, indexer_heads, generator=generator, dtype=torch.float64)
    scores, positions = glm._own_candidates_batched(query, weights, batch, first_own, 0.25)
    want_scores, want_positions = glm._own_candidates_each(query, weights, [rows_g[2] for rows_g in each],
                                                           first_own, 0.25)
    assert torch.equal(positions, want_positions)
    padded = torch.isinf(want_scores)  # past a sample's count: -inf in both
    ragged = len({rows_g[2].shape[0] for rows_g in each}) > 1
    assert torch.equal(torch.isinf(scores), padded) and bool(padded.any()) == ragged
    torch.testing.assert_close(scores, want_scores, rtol=TOL, atol=TOL * float(want_scores[~padded].abs().max()))


PATHS = ["_own_partial_batched", "_own_partial_each", "_own_candidates_batched", "_own_candidates_each"]


@pytest.fixture(scope="module")
def model():
    return tiny_glm_moe_dsa()


def test_one_turn_takes_the_batched_path_and_equals_each(model, monkeypatch):
    """G = 4 samples, 7 tokens, no eos: every step's slots are one run at one length, so every layer of every
    decode step (4 layers, 2 with a full indexer) takes the batched calls and none per sample; with batch_rows
    refused the per-sample calls run instead and give the same tokens and log-probs."""
    poison_rows(monkeypatch)
    samples, new_tokens, layers, full = 4, 7, model.config.num_hidden_layers, 2
    prompt, config = family_prompt("glm_moe_dsa"), FAMILIES["glm_moe_dsa"]["longstraw"]
    steps = []
    real_step = glm.GlmMoeDsaAdapter.decode_step

    def step(self, ids_G, *args, **kwargs):
        steps.append(ids_G.numel())
        return real_step(self, ids_G, *args, **kwargs)

    monkeypatch.setattr(glm.GlmMoeDsaAdapter, "decode_step", step)
    counts = counting(monkeypatch, glm, PATHS)
    with glm_reference():
        batched = generate(model, prompt, samples, new_tokens, temperature=0.8, seed=2, longstraw=config)
    assert samples in steps and [len(ids) for ids in batched.response_ids] == [new_tokens] * samples
    assert counts == {"_own_partial_batched": len(steps) * layers, "_own_partial_each": 0,
                      "_own_candidates_batched": len(steps) * full, "_own_candidates_each": 0}

    steps.clear()
    counts.update(dict.fromkeys(PATHS, 0))
    monkeypatch.setattr(OwnRows, "batch_rows", lambda self, layer, slots, extra=0: None)
    with glm_reference():
        each = generate(model, prompt, samples, new_tokens, temperature=0.8, seed=2, longstraw=config)
    assert counts == {"_own_partial_batched": 0, "_own_partial_each": len(steps) * layers,
                      "_own_candidates_batched": 0, "_own_candidates_each": len(steps) * full}
    for a, b in zip(batched.response_ids, each.response_ids, strict=True):
        assert torch.equal(a, b), (a.tolist(), b.tolist())
    for a, b in zip(batched.logprobs, each.logprobs, strict=True):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=TOL, atol=0)
