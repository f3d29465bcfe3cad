"""The GRPO transaction: capture, score, replay, prefix pass, reduce, over a topology.

transaction.py   grpo_backward: the transaction, written once over a topology
shared.py        grpo_backward_shared: the groups of a step that share a document, as one tree transaction
document.py      the shared document: where it ends, its captures (the tree's root), the groups' d(state) summed
topology.py      Topology, OneRank and ContextParallel, build_topology: where the prompt lives, what each phase
                 exchanges
interfaces.py    what replay's attention reaches on other ranks (RemoteAttention, RemoteSelection)
lockstep.py      Schedule and Lockstep: the padding calls that keep ranks' collectives paired (ZeRO-3, EP, CP)
state.py         PrefixState: the captured prompt's pages, carry and checkpoints, and the one-rank capture
replay.py        replay of one member at a time from the captured state, with autograd
prefix_pass.py   exact mode's one-rank prefix pass: the prompt's chunks in reverse
memory.py        phase timers and the host memory returned between phases
cp/              the context-parallel pieces ContextParallel runs
"""
