"""The gathered CP replay's two exchanges (grpo/cp/gathered.py), on 2 and 3 gloo ranks, both layouts, uneven shards:

  gather   every rank's pool then holds the whole prompt's rows of every stream, in prompt order, bit for bit
  return   the pages' gradients each rank left on its gathered pool, summed over the ranks, land on the rows' owners'
           gradient pages: the reduce-scatter (rank-major, padded shards) against the plain all-reduce form
           (return_grads_reference) and against the sum computed here, float64 (each rank's gradients are drawn
           from a seed every rank knows); streams without a gradient (the indexer keys) get none

The whole-step proof (gradients equal to the single-process reference) is test_cp_spread.py's gathered cases; this
one pins the layout arithmetic, where an off-by-one piece or a rank's rows in the wrong order would be exact-looking
elsewhere only by luck. Tolerance: 1e-12 (float64 sums of 2 or 3 terms in another order).
"""

import os

import pytest
import torch
from cp_scripts.harness import fork_ranks
from glm_models import tiny_glm_moe_dsa

PROMPT = 23  # captured tokens; zigzag over 2 ranks: pieces of 6/6/6/5, over 3: 4/4/4/4/4/3
CASES = [(2, "zigzag"), (3, "zigzag"), (3, "contiguous")]


def _whole(stream, length, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(length, *stream.shape, generator=gen, dtype=torch.float64).to(stream.dtype)


def _body(rank, world, layout, out_dir):
    import torch.distributed as dist

    from ds_longstraw import parse_config
    from ds_longstraw.arch import adapter_for
    from ds_longstraw.grpo.cp.gathered import GatheredPages, return_grads_reference
    from ds_longstraw.grpo.state import open_prefix_state
    from ds_longstraw.parallel.groups import CPContext

    cp = CPContext(dist.new_group(list(range(world)), backend="gloo"))
    cp.layout = layout
    adapter = adapter_for(tiny_glm_moe_dsa(torch.float64))
    longstraw = parse_config({"prefix_grad": "exact", "cp_size": world, "page_tokens": 4})
    pieces = cp.pieces(PROMPT)
    states = []
    for _ in range(2):  # one for the reduce-scatter, one for the reference
        state = open_prefix_state(adapter, longstraw, pieces.tokens, "exact", rank, length=PROMPT,
                                  offset=pieces.mine[0][0])
        for spec in adapter.specs:
            for seed, stream in enumerate(spec.streams):
                state.pool.append(spec.layer, stream.name,
                                  pieces.local_tokens(_whole(stream, PROMPT, 100 * spec.layer + seed)))
        states.append(state)
    results = {}
    for which, state in zip(("reduce_scatter", "reference"), states, strict=True):
        gathered = GatheredPages(cp, adapter, state, "exact")
        for spec in adapter.specs:
            for seed, stream in enumerate(spec.streams):
                whole = gathered.pool.read(spec.layer, stream.name)
                assert torch.equal(whole, _whole(stream, PROMPT, 100 * spec.layer + seed)), (spec.layer, stream.name)
                if stream.grad:  # this rank's members' gradients, drawn from a seed of the rank
                    gathered.pool.add_grad(spec.layer, stream.name, 0,
                                           _whole(stream, PROMPT, 7919 * (rank + 1) + 100 * spec.layer + seed))
        if which == "reduce_scatter":
            gathered.release()
        else:
            return_grads_reference(cp, gathered)
            gathered.pool.release()
        results[which] = {(spec.layer, stream.name): state.pool.read_grad(spec.layer, stream.name).clone()
                          for spec in adapter.specs for stream in spec.streams}
        results[which + "_has_grad"] = {(spec.layer, stream.name): state.pool._stream(spec.layer, stream.name).grad
                                        is not None for spec in adapter.specs for stream in spec.streams}
    expected = {}
    for spec in adapter.specs:
        for seed, stream in enumerate(spec.streams):
            if stream.grad:
                total = sum(_whole(stream, PROMPT, 7919 * (r + 1) + 100 * spec.layer + seed) for r in range(world))
                expected[(spec.layer, stream.name)] = pieces.local_tokens(total)
    results["expected"] = expected
    torch.save(results, os.path.join(out_dir, f"result.rank{rank}.pt"))


@pytest.mark.parametrize("world,layout", CASES, ids=[f"cp{w}-{layout}" for w, layout in CASES])
def test_gathered_pages_and_their_gradients_return(tmp_path, world, layout):
    fork_ranks(world, _body, (layout, str(tmp_path)), str(tmp_path), what="gathered pages")
    for rank in range(world):
        result = torch.load(tmp_path / f"result.rank{rank}.pt", weights_only=False)
        assert result["expected"], "no stream with a gradient"
        for key, grad in result["reduce_scatter"].items():
            if key in result["expected"]:
                torch.testing.assert_close(grad, result["expected"][key], rtol=0, atol=1e-12)
                torch.testing.assert_close(grad, result["reference"][key], rtol=0, atol=1e-12)
            else:  # the indexer keys take no gradient: no gradient pages made for them
                assert not result["reduce_scatter_has_grad"][key] and not result["reference_has_grad"][key], key
