"""The DeepSpeed engine's expert slices ("longstraw": {"ep_size": E}): built, kept out of ZeRO, reduced, stepped
and saved here.

ZeRO partitions and reduces every parameter it is given over all data-parallel ranks, which assumes that every rank
holds the same tensor. An expert slice differs from rank to rank, so `initialize` shards the experts
(shard_experts) and takes the slices out of the module's registered parameters: they stay plain attributes of
their experts module, where the adapter reads them, and DeepSpeed never sees them (nor partitions, gathers, reduces
or steps them). This module does for them what the engine does for the rest, in the engine's terms:

  groups   consecutive ranks [k E, (k+1) E) form EP group k (under context parallelism: the CP group); the ranks
           holding the same slice (EP rank r of every EP group) form its expert-data-parallel group
  reduce   after the step's one reduction, a slice's gradient holds every token of its EP group that was routed
           to it (the all-to-all brought them). The engine averages the other gradients over the W data-parallel
           ranks, so a slice's gradient is summed over its expert-data-parallel group and divided by W. (Under
           context parallelism each CP rank sends the whole replay and cp_size x its prefix share, exactly as the
           other gradients count them: parallel/experts.py, topology.py.)
  step     an optimizer of the client optimizer's class and hyperparameters (or of the config's "optimizer"
           block), over float32 master copies of the slices when they are in a lower precision, at the engine's
           current learning rate
  save     every rank of the first expert-data-parallel replica writes its slices, their master copies and
           optimizer state to <dir>/<tag>/experts_ep<E>_rank<r>.pt beside the engine's checkpoint; load reads the
           file of its EP rank, as data only (engine/safe_load.py), and refuses one of another EP size or shape.
"""

import inspect
import os

import torch
import torch.distributed as dist

from ds_longstraw.arch import expert_parallel, shard_experts, unregister_expert_slices
from ds_longstraw.engine.safe_load import load_data


def _gathered(params):
    """A model built under zero.Init holds partitioned experts: gather one block's (a collective, the same on every
    rank) while shard_experts slices them."""
    import deepspeed

    partitioned = [p for p in params if hasattr(p, "ds_id")]
    return deepspeed.zero.GatheredParameters(partitioned, enabled=bool(partitioned))


class ExpertSlices:
    """This rank's expert slices under the engine: their gradients' reduction, their optimizer, their checkpoint."""

    def __init__(self, model, ep_group, expert_dp_group, world):
        self.local = shard_experts(model, ep_group, gather=_gathered)
        self.ep = expert_parallel(model)
        self.expert_dp_group, self.world = expert_dp_group, world
        self.params = unregister_expert_slices(model)  # qualified name -> slice, out of ZeRO's sight
        self.replaced = self.ep.replaced  # the whole expert tensors a client optimizer may still hold
        self.masters = {}
        self.optimizer = None

    # -- optimizer -------------------------------------------------------------------------------------------
    def trainable(self):
        return {name: p for name, p in self.params.items() if p.requires_grad}

    def _master(self, param):
        """The tensor the optimizer steps: the slice itself in float32, else a float32 master copy."""
        if param.dtype == torch.float32:
            return param
        master = param.detach().float().clone().requires_grad_(True)
        self.masters[id(param)] = master
        return master

    def make_optimizer(self, client_optimizer, ds_config):
        """The slices' optimizer: the client optimizer's class and defaults, or the config's optimizer block."""
        targets = [self._master(p) for p in self.trainable().values()]
        if not targets:
            return
        if client_optimizer is not None:
            cls = type(client_optimizer)
            accepted = inspect.signature(cls.__init__).parameters  # defaults may hold keys the class takes none of
            self.optimizer = cls(targets, **{k: v for k, v in client_optimizer.defaults.items() if k in accepted})
        else:
            self.optimizer = optimizer_from_block(targets, ds_config.get("optimizer"))

    # -- one step ---------------------------------------------------------------------------------------------
    def reduce_(self):
        """Sum each slice's gradient over its expert-data-parallel group and divide by the data-parallel world
        size (see the module docstring)."""
        for param in self.trainable().values():
            grad = torch.zeros_like(param, dtype=torch.float32) if param.grad is None else param.grad.float()
            if dist.get_world_size(group=self.expert_dp_group) > 1:
                dist.all_reduce(grad, group=self.expert_dp_group)
            param.grad = grad.div_(self.world).to(param.dtype)
            master = self.masters.get(id(param))
            if master is not None:
                master.grad = grad

    def step(self, lr):
        """The slices' optimizer step at the engine's learning rate; gradients cleared after."""
        if self.optimizer is None:
            return
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for param in self.trainable().values():
                master = self.masters.get(id(param))
                if master is not None:
                    param.copy_(master)
                param.grad = None

    # -- checkpoints -----------------------------------------------------------------------------------------
    def _path(self, directory, tag):
        return os.path.join(directory, str(tag), f"experts_ep{self.ep.size}_rank{self.ep.rank}.pt")

    def save(self, directory, tag):
        if dist.get_rank(group=self.expert_dp_group) == 0:  # one copy of each slice
            path = self._path(directory, tag)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save({"ep_size": self.ep.size, "experts": (self.local.start, self.local.stop),
                        "trainable": sorted(self.trainable()),
                        "params": {n: p.detach().clone() for n, p in self.params.items()},
                        "masters": {n: self.masters[id(p)].detach().clone() for n, p in self.params.items()
                                    if id(p) in self.masters},
                        "optimizer": None if self.optimizer is None else self.optimizer.state_dict()}, path + ".tmp")
            os.replace(path + ".tmp", path)  # a crash mid-write leaves no half file under the real name
        dist.barrier()

    def load(self, directory, tag):
        path = self._path(directory, tag)
        if not os.path.exists(path):
            raise ValueError(f"checkpoint {os.path.join(directory, str(tag))} has no expert slices for EP rank "
                             f"{self.ep.rank} of {self.ep.size} ({os.path.basename(path)}): was it saved with "
                             f"'longstraw.ep_size' = {self.ep.size}?")
        saved = load_data(path)  # data only (tensors, numbers, strings): a file needing more is refused, naming it
        if tuple(saved["experts"]) != (self.local.start, self.local.stop) or set(saved["params"]) != set(self.params):
            raise ValueError(f"{path}: experts {saved['experts']} of parameters {sorted(saved['params'])[:2]}..., "
                             f"this rank holds experts {(self.local.start, self.local.stop)}")
        with torch.no_grad():
            for name, param in self.params.items():
                value = saved["params"][name]
                if value.shape != param.shape:
                    raise ValueError(f"{path}: {name} has shape {tuple(value.shape)}, this model's slice "
                                     f"{tuple(param.shape)}")
                param.copy_(value)
                master = self.masters.get(id(param))
                if master is not None:
                    master.copy_(saved["masters"][name])
        if self.optimizer is not None and saved["optimizer"] is not None:
            self.optimizer.load_state_dict(saved["optimizer"])


def without_expert_params(params, replaced):
    """A parameter list (or param groups) without the whole expert tensors that sharding replaced."""
    params = list(params)
    if params and isinstance(params[0], dict):
        return [dict(group, params=[p for p in group["params"] if id(p) not in replaced]) for group in params]
    return [p for p in params if id(p) not in replaced]


# DeepSpeed optimizer block type -> torch class and the block's parameters torch understands. DeepSpeed's "Adam"
# decouples weight decay unless adam_w_mode is false (its FusedAdam / DeepSpeedCPUAdam default).
_TORCH_OPTIMIZERS = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}
_KNOWN = {"lr", "betas", "eps", "weight_decay", "momentum", "dampening", "nesterov", "amsgrad"}


def optimizer_from_block(params, block):
    if not block:
        raise ValueError("'longstraw.ep_size' > 1: the expert slices need an optimizer: pass optimizer= or give "
                         "the DeepSpeed config an \"optimizer\" block")
    kind = str(block.get("type", "")).lower()
    options = dict(block.get("params") or {})
    if kind == "adam":
        kind = "adamw" if options.pop("adam_w_mode", True) else "adam"
    cls = _TORCH_OPTIMIZERS.get(kind) or (torch.optim.Adam if kind == "adam" else None)
    if cls is None:
        raise ValueError(f"'optimizer.type' = {block.get('type')!r}: the expert slices (ep_size > 1) step with "
                         "torch's AdamW, Adam or SGD; use one of those types or pass optimizer=")
    return cls(params, **{k: v for k, v in options.items() if k in _KNOWN})


def check_engine_settings(ds_config, longstraw):
    """ValueError (before any work) for what the engine does not run with expert slices."""
    if longstraw.ep_size == 1:
        return
    clip = float(ds_config.get("gradient_clipping", 0.0) or 0.0)
    if clip > 0:
        raise ValueError(f"'gradient_clipping' = {clip} with 'longstraw.ep_size' = {longstraw.ep_size}: the engine's "
                         "global gradient norm does not see the expert slices (kept out of ZeRO), so clipping would "
                         "not be global; set it to 0")
    if (ds_config.get("fp16") or {}).get("enabled"):
        raise ValueError("'fp16.enabled' with 'longstraw.ep_size' > 1: the expert slices are not loss-scaled; use "
                         "bf16 or float32")
    stage = int((ds_config.get("zero_optimization") or {}).get("stage", 0))
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"'zero_optimization.stage' = {stage}")

