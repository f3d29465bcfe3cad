"""Expert parallelism: a MoE layer's routed experts partitioned over the ranks of an EP group, and the routed
(token, expert) pairs sent to the rank that owns the expert and back.

Rank r of E owns the contiguous experts [r n/E, (r+1) n/E). The router runs on every rank (it is replicated), so
every rank knows where each of its pairs goes:

  dispatch  pairs sorted by owner (stable: token-major within an owner); counts exchanged (all_to_all_single);
            each pair's token vector and its expert's index on the owner travel by all_to_all_single
  compute   the owner runs its local experts over every pair it received, one expert at a time over that
            expert's pairs (arch/: the family's local computation)
  return    results travel back by the reverse all_to_all_single and are weighted by the router's weights where
            the token lives, then summed over the token's k pairs
No pair is dropped (no capacity factor). Autograd runs through both all-to-alls (the backward of one is the other
in reverse), so the router's and the attention's gradients stay on the token's rank and the experts' on their
owner, which receives every EP rank's pairs: an owner's expert gradient is the sum over the EP group's tokens.

Every rank of the EP group must make the same sequence of dispatches (collectives), forward and backward: the
transaction pads this rank's calls with lockstep.Lockstep over the EP group (transaction.py), as it does for
ZeRO-3's weight gathers.
"""

import torch
import torch.distributed as dist

# The attribute shard_experts sets on each sharded expert parameter: (first expert, last + 1, experts in all)
EXPERT_SLICE = "expert_slice"


def is_expert_param(param) -> bool:
    """Whether `param` holds only this rank's slice of a layer's experts (its gradient is complete on this rank:
    the all-to-all brought every EP rank's pairs to it, so no other reduction over the EP group may touch it)."""
    return getattr(param, EXPERT_SLICE, None) is not None


class ExpertParallel:
    """This rank's place in an EP group over `experts` routed experts (per MoE layer), and its traffic counters."""

    def __init__(self, process_group, experts):
        if process_group is None:
            raise ValueError("expert parallelism needs an explicit process group (ep_group)")
        self.process_group = process_group
        self.size = dist.get_world_size(group=process_group)
        self.rank = dist.get_rank(group=process_group)
        self.ranks = tuple(dist.get_process_group_ranks(process_group))
        if experts <= 0:
            raise ValueError(f"expert parallelism needs routed experts, the model has {experts}")
        if experts % self.size:
            raise ValueError(f"{experts} routed experts cannot be split evenly over an EP group of {self.size} ranks "
                             "(ep_size must divide the number of routed experts)")
        self.experts = experts
        self.per_rank = experts // self.size
        self.local = range(self.rank * self.per_rank, (self.rank + 1) * self.per_rank)
        self.reset()

    def reset(self):
        """Zero the counters (a group's report covers its transaction only)."""
        self.calls = 0
        self.pairs_received = 0  # pairs this rank's experts computed (its load)
        self.pairs_routed = 0  # pairs this rank's tokens made
        self.bytes_sent = 0  # token vectors out and results back, from this rank, forward only

    def report(self) -> dict:
        """Load and traffic over the EP group (collective: every EP rank calls it)."""
        loads = torch.tensor([float(self.pairs_received)], dtype=torch.float64)
        gathered = [torch.zeros_like(loads) for _ in range(self.size)]
        dist.all_gather(gathered, loads, group=self.process_group)
        loads = [float(t) for t in gathered]
        mean = sum(loads) / len(loads)
        return {"ep_size": self.size, "ep_rank": self.rank, "experts": list(self.local), "dispatches": self.calls,
                "pairs_routed": self.pairs_routed, "pairs_received": self.pairs_received,
                "pairs_received_per_rank": loads, "load_imbalance": max(loads) / mean if mean else 1.0,
                "bytes_sent": self.bytes_sent}


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of rows (send_counts rows to each rank, recv_counts from each), differentiable: the
    backward sends the gradients back the way the rows came."""

    @staticmethod
    def forward(ctx, rows, send_counts, recv_counts, group):
        out = rows.new_empty((sum(recv_counts), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), recv_counts, send_counts, group=group)
        ctx.counts, ctx.process_group = (send_counts, recv_counts), group
        return out

    @staticmethod
    def backward(ctx, d_out):
        send_counts, recv_counts = ctx.counts
        d_rows = d_out.new_empty((sum(send_counts), *d_out.shape[1:]))
        dist.all_to_all_single(d_rows, d_out.contiguous(), send_counts, recv_counts, group=ctx.process_group)
        return d_rows, None, None, None


def _exchange(values, send_counts, recv_counts, group):
    """all_to_all_single of a tensor that carries no gradient (counts, expert indices)."""
    out = values.new_empty((sum(recv_counts), *values.shape[1:]))
    dist.all_to_all_single(out, values.contiguous(), recv_counts, send_counts, group=group)
    return out


def dispatch(ep, x_TC, experts_TK, weights_TK, run_local):
    """out [T, C] = sum over k of weights[t, k] * expert_{experts[t, k]}(x[t]), the experts on their owners.

    experts_TK: global expert indices (int); weights_TK: the router's weights (any float dtype; the products are
    formed in the promoted dtype and summed in x's, as the model's own experts do); run_local(tokens [R, C],
    local expert index [R]) -> [R, C]: this rank's experts over the pairs it received."""
    tokens, k = experts_TK.shape
    flat = experts_TK.reshape(-1).long()
    owners = torch.div(flat, ep.per_rank, rounding_mode="floor")
    order = torch.argsort(owners, stable=True)
    send_counts = torch.bincount(owners, minlength=ep.size)
    recv_counts = _exchange(send_counts, [1] * ep.size, [1] * ep.size, ep.process_group)
    send, recv = send_counts.tolist(), recv_counts.tolist()
    pair_tokens = x_TC[torch.div(order, k, rounding_mode="floor")]
    local_ids = _exchange(flat[order] - owners[order] * ep.per_rank, send, recv, ep.process_group)
    received = _AllToAll.apply(pair_tokens, send, recv, ep.process_group)
    results = _AllToAll.apply(run_local(received, local_ids), recv, send, ep.process_group)
    pair_out = results[torch.argsort(order)].view(tokens, k, x_TC.shape[-1])  # back in (token, k) order
    ep.calls += 1
    ep.pairs_routed += flat.numel()
    ep.pairs_received += sum(recv)
    row = x_TC.shape[-1] * x_TC.element_size()
    ep.bytes_sent += (sum(send) - send[ep.rank]) * row + (sum(recv) - recv[ep.rank]) * row
    return (pair_out * weights_TK.unsqueeze(-1)).to(x_TC.dtype).sum(dim=1)


def dispatch_reference(x_TC, experts_TK, weights_TK, run_expert):
    """Plain version of dispatch on one rank holding every expert: run_expert(tokens [R, C], expert) -> [R, C]."""
    out = torch.zeros_like(x_TC)
    for expert in torch.unique(experts_TK).tolist():
        token, slot = torch.where(experts_TK == expert)
        out.index_add_(0, token, (run_expert(x_TC[token], expert) * weights_TK[token, slot, None]).to(x_TC.dtype))
    return out


def _ranks(group):
    """Global ranks of a process group (or of a CPContext's group)."""
    return tuple(dist.get_process_group_ranks(getattr(group, "process_group", group)))


def check_expert_parallel(ep, longstraw, ep_group, cp_group=None):
    """ValueError (before any work) when the model's expert sharding, the settings and the groups disagree.
    ep: the model's ExpertParallel (None: its experts are whole); cp_group: the CP process group, if any."""
    if longstraw.ep_size == 1:
        if ep is not None:
            raise ValueError(f"the model's experts are sharded over {ep.size} ranks (shard_experts) but "
                             f"'longstraw.ep_size' = 1: set it to {ep.size} and pass ep_group")
        if ep_group is not None:
            raise ValueError("ep_group was given but 'longstraw.ep_size' = 1")
        return
    if ep_group is None:
        raise ValueError(f"'longstraw.ep_size' = {longstraw.ep_size} needs ep_group (the process group the experts "
                         "are sharded over)")
    if ep is None:
        raise ValueError(f"'longstraw.ep_size' = {longstraw.ep_size}: the model's experts are whole; call "
                         "ds_longstraw.shard_experts(model, ep_group) first")
    if ep.size != longstraw.ep_size or _ranks(ep_group) != ep.ranks:
        raise ValueError(f"'longstraw.ep_size' = {longstraw.ep_size} with ep_group ranks {list(_ranks(ep_group))}, "
                         f"but the experts were sharded over ranks {list(ep.ranks)}")
    if cp_group is not None and longstraw.cp_size > 1 and _ranks(cp_group) != ep.ranks:
        raise ValueError(f"under context parallelism the experts are sharded over the CP group: ep_group ranks "
                         f"{list(ep.ranks)}, cp_group ranks {list(_ranks(cp_group))}")
