"""A 5,000-token prompt in float32, exact mode, against full-sequence autograd: on one rank and over CP 2.

Equivalence chain (float32 model; the same weights cast to float64 give the yardstick):
  grpo_backward(exact, float32), one rank and every rank of CP 2
      == full-sequence autograd of prompt + response for every member (transformers' own float32 forward)
  both measured against that full-sequence autograd in float64 end to end (float64_model(delta_rule=
  "transformers"): transformers' own chunked delta rule and norms evaluated in float64).

What the sizes cross (4,999 captured tokens: the prompt's last token is replayed with each response):
  GDN chunks of 64: 78 whole chunks and a partial one of 7 tokens;
  pages of 1,000 tokens (5 pages, the last of 999) that capture chunks and prefix segments of 1,536 tokens
  straddle (segments start at 0, 1536, 3072, 4608);
  attention key blocks of KEY_BLOCK = 2,048 (ds_longstraw.kernels.attention.reference): the exact-mode backward walks a
  segment's past pages (up to 4,608 keys) and the replay's (4,999) in key blocks; the one-rank test sees a
  full block go by. Under CP 2 each rank holds 2,500 / 2,499 keys, again more than one block.

Tolerance: the transaction's float32 error against float64 (relative L2 over all parameter gradients; max abs over
log-probs; the loss) is at most 3x the float32 full-sequence reference's own error against float64. Both are float32
evaluations of one function in different association orders (chunked vs whole-sequence attention and delta rule,
LSE merges over pages, key blocks and ranks), so their rounding errors are of one size. Measured: gradients 4.7e-7
(reference) vs 4.2e-7 (one rank) and 4.4e-7 (CP 2); log-probs 2.3e-7 vs 2.3e-7 and 3.4e-7; loss 1.0e-8 for all.
Wrong paths err far beyond the bound: detached mode 0.33, one key's dK dropped per full key block 5e-4. Log-probs
and loss are near rounding level, where the ratio of two errors is noise: they also get one float32 ulp of their
largest magnitude (4.8e-7 for log-probs near -4.6).

The CP ranks are forked by tests/cp_scripts/harness.py, which runs them under float64_model(); for a float32 model
that changes nothing the transaction calls (the swapped norms are transformers' formula in float32, and the
transaction runs its own delta rule), which test_harness_context_changes_nothing_in_float32 checks bit for bit.
"""

import copy

import numpy as np
import pytest
import torch
from cp_scripts.harness import make_group, run_cp
from grads import grads_of, relative_l2
from models import float64_model, full_sequence_logprobs, tiny_qwen3_5

from ds_longstraw import GRPOObjective, grpo_backward
from ds_longstraw.kernels.attention import KEY_BLOCK
from ds_longstraw.kernels.attention import partial as attention_module
from ds_longstraw.parallel import shard_bounds

PROMPT, RESPONSES, SEED = 5000, [4, 3], 11
CHUNK, PAGE, REPLAY_BLOCK, GDN_CHUNK = 1536, 1000, 1024, 64
# One attention layer between GDN layers: prompt attention outputs feed later GDN state, so the prefix pass must
# carry gradients through the pages into the layers below and the GDN carries across segments.
MODEL = dict(layers=4, layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
             max_position_embeddings=8192)
CASE = dict(name="long-prompt-exact-float32", prompt_len=PROMPT, response_lens=RESPONSES, mode="exact", chunk=CHUNK,
            page=PAGE, block=REPLAY_BLOCK, dtype="float32", model=MODEL, seed=SEED)
CONFIG = {"prefix_grad": "exact", "capture_chunk": CHUNK, "page_tokens": PAGE, "replay_block": REPLAY_BLOCK}
FACTOR = 3.0


def test_sizes_cross_every_boundary():
    captured = PROMPT - 1
    assert captured % GDN_CHUNK and captured // GDN_CHUNK >= 2
    assert captured % PAGE and CHUNK % PAGE and captured % CHUNK
    last_segment = (captured // CHUNK) * CHUNK
    assert 2 * KEY_BLOCK < last_segment < captured  # the last segment's past and the replay's: 3 key blocks each
    assert all(KEY_BLOCK < hi - lo for lo, hi in shard_bounds(captured, 2))


def _full_sequence(model, group, objective):
    def run():
        logps = full_sequence_logprobs(model, group.prompt_ids, group.response_ids)
        loss = objective.group_loss(group, logps)
        loss.backward()
        return float(loss.detach()), [lp.detach().double() for lp in logps]

    grads, (loss, logps) = grads_of(model, run)
    return {n: g.double() for n, g in grads.items()}, loss, logps


@pytest.fixture(scope="module")
def setup():
    """The float32 model and group, and the full-sequence results in float32 and in float64 (same weights)."""
    model = tiny_qwen3_5(dtype=torch.float32, **MODEL)
    group = make_group(PROMPT, RESPONSES, seed=SEED)
    objective = GRPOObjective()
    reference = _full_sequence(model, group, objective)
    wide = copy.deepcopy(model).double()
    with float64_model(delta_rule="transformers"):
        exact = _full_sequence(wide, group, objective)
    return model, group, objective, reference, exact


def _ulp(values):
    return float(np.spacing(np.float32(max(abs(float(v)) for v in values))))


def _check(label, grads, loss, logps, reference, exact):
    ref_grads, ref_loss, ref_logps = reference
    grads64, loss64, logps64 = exact
    ref_error = relative_l2(ref_grads, grads64)
    error = relative_l2({n: g.double() for n, g in grads.items()}, grads64)
    assert error <= FACTOR * ref_error, f"{label}: {error:.2e} > {FACTOR} x {ref_error:.2e}"

    ref_lp_error = max(float((a - b).abs().max()) for a, b in zip(ref_logps, logps64, strict=True))
    lp_error = max(float((a.double() - b).abs().max()) for a, b in zip(logps, logps64, strict=True))
    lp_ulp = _ulp(torch.cat(logps64))
    assert lp_error <= FACTOR * ref_lp_error + lp_ulp, (label, lp_error, ref_lp_error)
    assert abs(loss - loss64) <= FACTOR * abs(ref_loss - loss64) + _ulp([loss64]), (label, loss, ref_loss, loss64)


def test_one_rank_matches_full_sequence(setup, monkeypatch):
    model, group, objective, reference, exact = setup
    key_counts = []
    backward = attention_module._backward
    monkeypatch.setattr(attention_module, "_backward", lambda q, k, *rest: key_counts.append(k.shape[1])
                        or backward(q, k, *rest))
    grads, result = grads_of(model, lambda: grpo_backward(model, group, objective, longstraw=CONFIG))
    assert KEY_BLOCK in key_counts, "no full key block went through the backward: the test lost its coverage"
    _check("one rank", grads, result.loss, result.logprobs, reference, exact)


def test_cp2_matches_full_sequence(setup, tmp_path):
    _, _, _, reference, exact = setup
    ranks = run_cp(2, [CASE], str(tmp_path))[CASE["name"]]
    for rank, result in enumerate(ranks):
        _check(f"CP 2 rank {rank}", result["grads"], result["loss"], result["logprobs"], reference, exact)
    assert all(torch.equal(ranks[1]["grads"][n], g) for n, g in ranks[0]["grads"].items())


def test_harness_context_changes_nothing_in_float32():
    """The CP ranks run under float64_model(): for a float32 model the transaction's results are the same bits."""
    model = tiny_qwen3_5(dtype=torch.float32, **MODEL)
    group = make_group(300, [3, 2], seed=SEED)
    config = dict(CONFIG, capture_chunk=70, page_tokens=50)
    plain, plain_result = grads_of(model, lambda: grpo_backward(model, group, longstraw=config))
    with float64_model():
        wrapped, wrapped_result = grads_of(model, lambda: grpo_backward(model, group, longstraw=config))
    assert all(torch.equal(plain[n], wrapped[n]) for n in plain)
    assert plain_result.loss == wrapped_result.loss
