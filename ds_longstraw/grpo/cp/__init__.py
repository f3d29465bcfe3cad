"""The transaction under context parallelism: what ContextParallel (../topology.py) runs on a sharded prompt.

The phases walk the model's layers and ask each layer's kind (kinds/, found by the spec's `combine`) for its
cross-rank step; none of these files names a kind:
capture.py        layer-major capture of a rank's shard
prefix_layers.py  exact mode's prefix pass layer-major: every rank at once, layer by layer
prefix_turns.py   exact mode's prefix pass in turns, remote pages served by their owners (kept for comparison)
spread.py         who replays which member under the replay spread (each rank its own members), results gathered
output_side.py    a mixer's output side in the prefix pass (gate, residual, MLP) with autograd from its output
kinds/            one folder per layer kind:
  attention/      "lse": (out, lse) partials across ranks (ring.py: capture, replay, grads; ulysses.py; the
                  layer-major step; the spread view)
  scan/           "affine_scan": a recurrence's summaries folded in prompt order (capture.py, backward.py)
  sparse/         "topk_lse": a global top-k from every rank's candidates, the selected rows' partials computed
                  where the rows live, merged by log-sum-exp (selection.py; the layer-major step; the spread view)
The process groups and the prompt's layout over them are ../../parallel/; a family's own cross-rank math (the
Gated DeltaNet state scan) lives with its adapter in ../../arch/.
"""
