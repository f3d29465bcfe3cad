"""What a training checkpoint holds, read without DeepSpeed's engine: the ZeRO-3 shards and the run record.

A checkpoint tag (`<save_dir>/<tag>/`, as `engine.save_checkpoint` writes it) holds one model-state file and one
optimizer-state file per rank. The trained weights are the optimizer's float32 master partitions (a partition per
rank, flat); frozen weights (a LoRA base) are partitions in the model-state files; persistent buffers sit whole in
the model-state files. DeepSpeed's own `deepspeed.utils.zero_to_fp32` parses them; here every file is memory-mapped
(torch.load mmap) and each tensor is assembled from its rank partitions only when asked for, so reading a tensor
costs that tensor, not the model.

The run record (`<tag>/longstraw/`, written by `save_record` beside the shards) is what the shards alone do not say:
the run config (LoRA settings, training dtype, the base checkpoint), the model's transformers config, and the
tokenizer when the run had one.

Every file is read as data (engine/safe_load.py): before DeepSpeed's parser opens any, each `.pt` file of the tag is
read with torch's weights_only unpickler and the types DeepSpeed's format needs, and a file that needs more is
refused, naming it (`trust_pickle` reads a trusted legacy file as the pickle it is).
"""

import contextlib
import glob
import io
import os
from dataclasses import dataclass
from typing import Any

import torch

from ds_longstraw.engine.safe_load import check_tag, load_data, load_deepspeed_file

RECORD = "longstraw"  # folder of the run record inside a checkpoint tag


def _absolute(path):
    return None if path is None else os.path.abspath(os.fspath(path))


def save_record(tag_dir, run, model, tokenizer=None):
    """Write the run record of a checkpoint tag (on one rank, after `engine.save_checkpoint(save_dir, tag)`).

    run: the RunConfig (engine/run_config.py); model: the trained module (a transformers model, or a peft model
    around one); tokenizer: the run's tokenizer or None. Paths in the run config are stored absolute: export runs
    later, from anywhere."""
    from omegaconf import OmegaConf

    folder = os.path.join(os.fspath(tag_dir), RECORD)
    os.makedirs(folder, exist_ok=True)
    run = OmegaConf.create(OmegaConf.to_container(run))
    for key in ("model.shape", "model.pretrained", "data.tokenizer", "data.path", "deepspeed_config"):
        value = OmegaConf.select(run, key)
        if value is not None:
            OmegaConf.update(run, key, _absolute(value))
    OmegaConf.save(run, os.path.join(folder, "run.yaml"))
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(os.path.join(folder, "tokenizer"))


@dataclass
class RunRecord:
    run: Any  # RunConfig
    model_config: Any  # transformers PretrainedConfig of the (base) model
    tokenizer_dir: str | None  # a directory AutoTokenizer loads, or None
    source: str  # where the record came from (for messages)


def load_record(tag_dir, run_config=None) -> RunRecord:
    """The run record of a checkpoint tag; or, given `run_config` (a run config YAML, for checkpoints saved by a
    script of one's own), the same facts rebuilt from that config as launch/train.py builds them."""
    from transformers import AutoConfig

    from ds_longstraw.engine.run_config import load_run_config

    folder = os.path.join(os.fspath(tag_dir), RECORD)
    if run_config is not None:
        from ds_longstraw.models.modeling import config_from_shape

        run = load_run_config(run_config)
        if run.model.shape is not None:
            config = config_from_shape(run.model.shape)
        else:
            config = AutoConfig.from_pretrained(run.model.pretrained)
        tokenizer = run.data.tokenizer or run.model.pretrained
        has_tokenizer = tokenizer is not None and any(
            os.path.exists(os.path.join(tokenizer, name)) for name in ("tokenizer.json", "tokenizer_config.json"))
        return RunRecord(run, config, tokenizer if has_tokenizer else None, f"run config {run_config}")
    if not os.path.isfile(os.path.join(folder, "run.yaml")):
        raise ValueError(f"{tag_dir} has no run record ({RECORD}/run.yaml): launch/train.py writes one with every "
                         "checkpoint; for a checkpoint saved by a script of your own, pass the run config that "
                         "describes its model (--config run.yaml)")
    run = load_run_config(os.path.join(folder, "run.yaml"))
    tokenizer = os.path.join(folder, "tokenizer")
    return RunRecord(run, AutoConfig.from_pretrained(folder), tokenizer if os.path.isdir(tokenizer) else None,
                     f"run record {folder}")


def checkpoint_tags(save_dir) -> list:
    """Tags in `save_dir` that hold model-state files, sorted."""
    found = glob.glob(os.path.join(os.fspath(save_dir), "*", "*_model_states.pt"))
    return sorted({os.path.basename(os.path.dirname(path)) for path in found})


def resolve_tag(save_dir, tag="latest") -> str:
    """The checkpoint directory of `tag` ("latest": the tag DeepSpeed's `latest` file names); ValueError naming
    the tags that exist when it is not there."""
    save_dir = os.fspath(save_dir)
    if not os.path.isdir(save_dir):
        raise ValueError(f"checkpoint directory {save_dir!r} does not exist")
    tags = checkpoint_tags(save_dir)
    if tag == "latest":
        latest = os.path.join(save_dir, "latest")
        if not os.path.isfile(latest):
            raise ValueError(f"{save_dir!r} has no 'latest' file; pass --tag, one of {tags}")
        with open(latest) as handle:
            tag = handle.read().strip()
    if tag not in tags:
        raise ValueError(f"tag {tag!r} is not a checkpoint in {save_dir!r}; its checkpoints are {tags}")
    return os.path.join(save_dir, tag)


@contextlib.contextmanager
def _quiet_mmap_loads():
    """torch.load memory-maps inside (DeepSpeed's parser loads model-state files without asking), and the parser's
    progress prints stay out of the user's output."""
    from torch.utils.serialization import config

    before = config.load.mmap
    config.load.mmap = True
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        config.load.mmap = before


class _FrozenTensor:
    """A frozen parameter as its rank partitions (memory-mapped); `contiguous()` assembles it, as zero_to_fp32's
    `_zero3_merge_frozen_params` does for all of them at once."""

    def __init__(self, fragments, shape):
        self.fragments, self.shape, self.dtype = fragments, shape, fragments[0].dtype

    def contiguous(self):
        return torch.cat(self.fragments, 0).narrow(0, 0, self.shape.numel()).view(self.shape)


class _ExpertSlices:
    """A parameter whose experts were sharded over an EP group (engine/expert_slices.py): its ranks' slices,
    memory-mapped from the experts_ep<E>_rank<r>.pt files, joined along the expert dimension on `contiguous()`."""

    def __init__(self, slices):
        self.slices = slices
        self.shape = torch.Size((sum(t.shape[0] for t in slices), *slices[0].shape[1:]))
        self.dtype = slices[0].dtype

    def contiguous(self):
        return torch.cat(self.slices, 0)


def expert_slice_files(tag_dir) -> list:
    """The expert-slice files of an EP run's checkpoint tag, in EP rank order (none: not an EP run)."""
    found = [f for f in os.listdir(tag_dir) if f.startswith("experts_ep") and f.endswith(".pt")]
    return sorted(found, key=lambda f: int(f.rsplit("_rank", 1)[1][:-3]))


def _expert_slices(tag_dir):
    """{name: _ExpertSlices} and the trained names among them, from an EP run's slice files (trained slices: their
    float32 master copies where the run kept one, as the optimizer's masters are read for the other weights)."""
    files = expert_slice_files(tag_dir)
    if not files:
        return {}, set()
    with _quiet_mmap_loads():
        saved = [load_data(os.path.join(tag_dir, f), mmap=True) for f in files]  # the project's own: data only
    size = saved[0]["ep_size"]
    if len(saved) != size or [s["experts"][0] for s in saved] != sorted(s["experts"][0] for s in saved):
        raise ValueError(f"{tag_dir}: {len(saved)} expert-slice files for an EP size of {size}")
    trained = set(saved[0].get("trainable", ()))
    slices = {}
    for name in saved[0]["params"]:
        source = "masters" if name in trained and name in saved[0].get("masters", {}) else "params"
        slices[name] = _ExpertSlices([s[source][name] for s in saved])
    return slices, trained


class ZeroCheckpoint:
    """The tensors of a ZeRO-3 checkpoint tag by the trained module's parameter and buffer names.

    shapes: name -> torch.Size of every parameter and persistent buffer (a tied weight under one name; `aliases`
    maps its other names to that one); trainable: the names the optimizer held; tensor(name): the full tensor
    (float32 for trained weights: the optimizer's master copy). trust_pickle: skip the data-only check of the
    tag's files (engine/safe_load.py), for a legacy checkpoint one trusts."""

    def __init__(self, tag_dir, trust_pickle=False):
        from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT, ZERO_STAGE
        from deepspeed.utils import zero_to_fp32

        tag_dir = os.path.abspath(os.fspath(tag_dir))
        if not trust_pickle:
            check_tag(tag_dir)  # before zero_to_fp32, which unpickles with weights_only=False, opens any file
        with _quiet_mmap_loads():
            states = zero_to_fp32.parse_model_states(zero_to_fp32.get_model_state_files(tag_dir))
            first = load_deepspeed_file(zero_to_fp32.get_optim_files(tag_dir)[0], trust_pickle, mmap=True)
            stage = first[OPTIMIZER_STATE_DICT][ZERO_STAGE]
            if int(stage) != 3:
                raise ValueError(f"{tag_dir} is a ZeRO stage-{int(stage)} checkpoint; export reads ZeRO-3 ones")
            # DeepSpeed's own reassembly: buffers, and one lazy GatheredTensor per trained parameter (its rank
            # partitions, memory-mapped, are joined on .contiguous()).
            lazy = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
                os.path.dirname(tag_dir), tag=os.path.basename(tag_dir), exclude_frozen_parameters=True,
                lazy_mode=True)
        self.world_size = len(states)
        self.trainable = {name for group in states[0].param_shapes for name in group}
        for name, shape in (states[0].frozen_param_shapes or {}).items():
            lazy[name] = _FrozenTensor([state.frozen_param_fragments[name] for state in states], shape)
        self.aliases = {alias: name for alias, name in states[0].shared_params}
        self._lazy = {name: value for name, value in lazy.items() if name not in self.aliases}
        experts, trained_experts = _expert_slices(tag_dir)  # an EP run's routed experts, kept out of ZeRO
        self._lazy.update(experts)
        self.trainable |= trained_experts
        self.shapes = {name: torch.Size(value.shape) for name, value in self._lazy.items()}

    def tensor(self, name) -> torch.Tensor:
        name = self.aliases.get(name, name)
        value = self._lazy[name]
        return value if isinstance(value, torch.Tensor) else value.contiguous()
