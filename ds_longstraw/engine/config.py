"""Reading the "longstraw" block out of a whole DeepSpeed config, at the door of `ds_longstraw.initialize`.

DeepSpeed ignores unknown top-level keys, so a misspelt block name ("long_straw", "longStraw") would silently run
with defaults: it is caught here. The block itself is validated by `LongstrawConfig` (extra keys forbidden). A few
DeepSpeed settings that the GRPO step depends on are checked here too, each error naming its key:

- gradient_accumulation_steps must be 1: `grpo_step` is one optimizer step per call (several groups per rank per
  step: pass a list of groups), and DeepSpeed only steps at its own accumulation boundary.
- zero_optimization.stage must be 1, 2 or 3: the one-reduction-per-group path (`coalesce_grad_reduction`) needs ZeRO.
- longstraw.cp_size must divide the world size (consecutive ranks form a CP group inside each data-parallel
  replica). Offload tiers hold each CP rank's own shard of pages.
"""

import difflib
import json
import os
from typing import Any

from ds_longstraw.config import BLOCK_NAME, LongstrawConfig, parse_config


def load_ds_config(config: dict[str, Any] | str | os.PathLike[str]) -> dict:
    """A DeepSpeed config as a dict: a dict, a path to a JSON (or hjson) file, or DeepSpeed's base64 form."""
    if isinstance(config, dict):
        return config
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.exists(path):
            with open(path) as handle:
                text = handle.read()
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                import hjson  # DeepSpeed reads hjson; accept what it accepts

                return dict(hjson.loads(text))
        import base64

        try:
            return json.loads(base64.urlsafe_b64decode(path).decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            pass
        raise ValueError(f"DeepSpeed config {path!r} is neither an existing file nor base64-encoded JSON")
    raise ValueError(f"DeepSpeed config must be a dict or a path, got {type(config).__name__}")


def _normalised(key: str) -> str:
    return "".join(ch for ch in key.lower() if ch.isalnum())


def near_miss_block_names(ds_config: dict) -> list:
    """Top-level keys that look like a misspelt "longstraw" ("long_straw", "longStraw", "long-straw", "longstraws")."""
    misses = []
    for key in ds_config:
        if not isinstance(key, str) or key == BLOCK_NAME:
            continue
        norm = _normalised(key)
        if norm == BLOCK_NAME or difflib.SequenceMatcher(None, norm, BLOCK_NAME).ratio() >= 0.8:
            misses.append(key)
    return misses


def _implied_accumulation(ds_config: dict[str, Any], world_size: int | None) -> tuple[Any, str | None]:
    """gradient_accumulation_steps as DeepSpeed will see it (None where it cannot be known yet)."""
    gas = ds_config.get("gradient_accumulation_steps", "auto")
    if gas not in ("auto", None):
        return gas, "gradient_accumulation_steps"
    micro, total = ds_config.get("train_micro_batch_size_per_gpu"), ds_config.get("train_batch_size")
    if world_size and isinstance(micro, int) and isinstance(total, int) and micro > 0:
        return total / (micro * world_size), "train_batch_size"
    return None, None


def read_block(ds_config: dict, world_size: int | None = None) -> LongstrawConfig:
    """Validate the DeepSpeed config's "longstraw" block (and the DeepSpeed keys grpo_step relies on).

    Raises ValueError naming the offending key. A missing block means defaults (enabled)."""
    misses = near_miss_block_names(ds_config)
    if misses:
        where = "" if BLOCK_NAME not in ds_config else f" (beside a '{BLOCK_NAME}' block)"
        raise ValueError(f"DeepSpeed config has a top-level key {misses[0]!r}{where}: did you mean '{BLOCK_NAME}'? "
                         "DeepSpeed ignores unknown top-level keys, so it would silently run with defaults")
    longstraw = parse_config(ds_config.get(BLOCK_NAME))
    if not longstraw.enabled:
        return longstraw
    gas, key = _implied_accumulation(ds_config, world_size)
    if gas is not None and gas != 1:
        raise ValueError(f"'{key}' = {ds_config[key]!r} means gradient_accumulation_steps={gas}: grpo_step takes "
                         "one optimizer step per call and needs 1; to put several groups per rank into one step, "
                         "pass grpo_step a list of groups")
    zero = ds_config.get("zero_optimization", {}) or {}
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    if stage not in (1, 2, 3):
        raise ValueError(f"'zero_optimization.stage' = {stage!r}: grpo_step reduces each group's gradients once "
                         "through DeepSpeed's coalesce_grad_reduction, which needs ZeRO stage 1, 2 or 3 (3 shards "
                         "the weights)")
    if longstraw.cp_size > 1:
        if world_size and world_size % longstraw.cp_size:
            raise ValueError(f"'{BLOCK_NAME}.cp_size' = {longstraw.cp_size} does not divide the world size "
                             f"{world_size}: consecutive ranks form a CP group inside each data-parallel replica")
    return longstraw


__all__ = ["LongstrawConfig", "load_ds_config", "near_miss_block_names", "read_block"]
