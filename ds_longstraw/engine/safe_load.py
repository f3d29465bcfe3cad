"""Checkpoint files are read as data: no file of a checkpoint runs code while it is read.

A `.pt` file is a pickle, and unpickling may call any function the file names: one crafted file in a checkpoint
directory (copied between clusters, downloaded, handed over by a colleague) would run as the training user the
moment a run resumes from it or `longstraw export` reads it. torch's `weights_only=True` unpickler builds only
tensors, numbers, strings, containers and the globals it is told to allow, and calls nothing else.

What is allowed, beyond torch's defaults (read from real checkpoints of this project's engine, ZeRO stages 0-3,
float32 and bfloat16, client and config optimizers, LR schedulers, CPU optimizer offload; see docs/checkpoints.md):
  ZeroStageEnum         the "zero_stage" of every optimizer-state file
  LossScaler            the "loss_scaler" of every optimizer-state file (a static scale of 1 without fp16)
  DynamicLossScaler     the same field under fp16 with dynamic loss scaling (read from DeepSpeed's stage-3
                        state_dict; DeepSpeed refuses fp16 on CPU, so no CPU checkpoint holds one)
  fragment_address      ZeRO-1/2 optimizer-state files ("param_slice_mappings")
The project's own files (expert slices) need none of them.

DeepSpeed's loaders (engine.load_checkpoint, deepspeed.utils.zero_to_fp32) call torch.load with
weights_only=False. They are not patched: `check_tag` reads every `.pt` file of the tag first with the allow-list
(memory-mapped: the tensors' bytes are not read) and refuses the tag, naming the file and the types, before any of
it is loaded. `trust_pickle` (run config `train.trust_pickle`, `longstraw export --trust-pickle`,
`engine.load_checkpoint(..., trust_pickle=True)`) skips the check for a legacy file one trusts.
"""

import os
import pickle
import re
import zipfile

import torch

TRUST_HINT = ("if you trust the file (loaded as a pickle, it runs whatever it names), opt in: `longstraw export "
              "--trust-pickle`, run config `train.trust_pickle=true`, or engine.load_checkpoint(..., "
              "trust_pickle=True)")


def deepspeed_globals() -> list:
    """The classes DeepSpeed's checkpoint format pickles (the module docstring says where each one sits)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def _needed_types(path, error) -> str:
    """The globals `path` names beyond those allowed: torch's opcode scan (which runs nothing) lists them all for
    a torch.save zip file; otherwise the one torch's unpickler stopped at, or its own reason."""
    try:
        names = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:  # not a torch.save zip file, or opcodes the scan does not know: torch's own message says
        names = []
    if not names:
        names = re.findall(r"GLOBAL ([\w.]+)", str(error))
    if names:
        return "type " + ", ".join(names)
    reason = re.search(r"WeightsUnpickler error: \s*(.+)", str(error))
    return "what torch's data-only unpickler refuses: " + (reason.group(1).strip() if reason else
                                                           str(error).splitlines()[0])


def load_data(path, allowed=(), mmap=False):
    """torch.load of `path` (onto the CPU) as data: weights_only=True with the globals `allowed` added. A file
    that needs anything else is a ValueError naming the file and the types; nothing of it has run."""
    with torch.serialization.safe_globals(list(allowed)):
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as error:
            needed = _needed_types(path, error)
    raise ValueError(f"{path}: refused before loading: it needs {needed}, which a checkpoint of data does not "
                     f"hold (tensors, numbers, strings, containers and DeepSpeed's checkpoint records); unpickling "
                     f"it could run code from the file; {TRUST_HINT}")


def load_deepspeed_file(path, trust_pickle=False, mmap=False):
    """One of DeepSpeed's checkpoint files: data and DeepSpeed's record types, or any pickle with trust_pickle."""
    if trust_pickle:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    return load_data(path, deepspeed_globals(), mmap=mmap)


def tag_files(tag_dir) -> list:
    """Every `.pt` file under a checkpoint tag (DeepSpeed's shards, the expert slices, any other), sorted."""
    found = []
    for folder, _, names in os.walk(tag_dir):
        found.extend(os.path.join(folder, name) for name in names if name.endswith(".pt"))
    return sorted(found)


def check_tag(tag_dir):
    """ValueError naming the file and the types when a `.pt` file under `tag_dir` needs more than data and
    DeepSpeed's record types. Every rank that calls it reads every file, so all of them refuse together (a rank
    that went on alone would wait in DeepSpeed's first collective). Memory-mapped where it can be: the pickles are
    read, the tensors' bytes are not."""
    allowed = deepspeed_globals()
    for path in tag_files(tag_dir):
        load_data(path, allowed, mmap=zipfile.is_zipfile(path))


def check_checkpoint(load_dir, tag=None):
    """check_tag for engine.load_checkpoint(load_dir, tag): tag None is the one DeepSpeed's `latest` file names
    (no such file: DeepSpeed loads nothing, and there is nothing to check)."""
    load_dir = os.fspath(load_dir)
    if tag is None:
        latest = os.path.join(load_dir, "latest")
        if not os.path.isfile(latest):
            return
        with open(latest) as handle:
            tag = handle.read().strip()
    check_tag(os.path.join(load_dir, str(tag)))
