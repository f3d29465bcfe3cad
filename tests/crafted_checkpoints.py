"""Checkpoints that would run code when read: a real checkpoint tag written by the engine, copied, with one more
entry in one of its `.pt` files, as issue 48 found one can be made (an object whose unpickling runs a shell
command). The command here only creates a marker file, so a test sees whether anything ran.
"""

import argparse
import os
import shlex
import shutil

import torch

from ds_longstraw.engine.safe_load import load_data, load_deepspeed_file


class RunsCommand:
    """Unpickled with weights_only=False, runs `touch <marker>` through os.system (pickle calls what __reduce__
    names)."""

    def __init__(self, marker):
        self.marker = os.fspath(marker)

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(self.marker)}",)


def legacy_entry():
    """A harmless object outside the allow-list, standing for a legacy file one trusts."""
    return argparse.Namespace(note="written by an older tool")


def copy_tag(save_dir, tag, out_dir):
    """out_dir/<tag>: a copy of save_dir/<tag>, and a `latest` file naming it."""
    os.makedirs(out_dir, exist_ok=True)
    shutil.copytree(os.path.join(save_dir, tag), os.path.join(out_dir, tag))
    with open(os.path.join(out_dir, "latest"), "w") as handle:
        handle.write(tag)
    return os.path.join(out_dir, tag)


def add_entry(path, key, value):
    """Rewrite a real checkpoint file with one more top-level entry (read back as data: it is the engine's)."""
    is_slice = os.path.basename(path).startswith("experts_")
    saved = load_data(path) if is_slice else load_deepspeed_file(path)
    saved[key] = value
    torch.save(saved, path)
