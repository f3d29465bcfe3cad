"""The transaction under context parallelism: what ContextParallel (../topology.py) runs on a sharded prompt.

capture.py        layer-major capture of a rank's shard (each layer's combine from its spec)
cp_attention.py   (out, lse) partials across ranks: capture (pages or queries travel), replay (all-gather), grads
cp_sparse.py      the "topk_lse" combine: a global top-k selection from every rank's candidates, the selected rows'
                  partials computed where the rows live, merged by log-sum-exp
ulysses.py        the capture's head/sequence all-to-all alternative for attention
prefix_layers.py  exact mode's prefix pass layer-major: every rank at once, layer by layer
prefix_sparse.py  ... at a layer that attends a global top-k selection
prefix.py         exact mode's prefix pass in turns, remote pages served by their owners (kept for comparison)
spread.py         the replay spread over the CP group (each rank its own members: queries out, partials back)
The process groups and the prompt's layout over them are ../../parallel/; a family's own cross-rank math (the
Gated DeltaNet state scan) lives with its adapter in ../../arch/.
"""
