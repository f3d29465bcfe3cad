"""`longstraw export`: a training checkpoint becomes a directory that transformers or peft load as it is.

    longstraw export runs/quickstart/ckpt --out runs/quickstart/hf              # full fine-tune
    longstraw export runs/lora/ckpt --tag step200 --out runs/lora/adapter       # LoRA / QLoRA: a peft adapter
    longstraw export runs/lora/ckpt --out runs/lora/merged --merge              # LoRA merged into full weights

What a run becomes:
  full fine-tune  config.json, generation_config.json, safetensors shards (+ index) in the training dtype or
                  --dtype, the tokenizer when the run had one: AutoModelForCausalLM.from_pretrained(out).
  LoRA, QLoRA     adapter_config.json + adapter_model.safetensors (+ the tokenizer):
                  PeftModel.from_pretrained(base, out), base = the run's model.pretrained (for QLoRA loaded 4-bit
                  again, as training did). A LoRA run over a model.shape (random weights) has no base directory
                  elsewhere: its base is written to out/base.
  --merge         LoRA only: W + scaling * B @ A per adapted linear layer, computed in float32, written as a full
                  model. Refused for QLoRA: the base weights exist only as 4-bit NF4 codes, and adding a
                  full-precision update to them gives either a model that is not the trained one (quantized again)
                  or a dequantized base the run never saw.

It runs in one CPU process from the checkpoint files (no launcher, no GPU): DeepSpeed's zero_to_fp32 parses the
shards (checkpoint_files.py, memory-mapped) and every tensor is assembled when its output shard is written,
so memory holds one output shard (--max-shard-size) and the tensor being assembled, not the model. The model's
names and shapes are those of a model built from the run record on the meta device; a checkpoint that does not match
them is refused with the names. The directory is written beside --out under a temporary name and renamed at the
end: a failed export leaves nothing, and an existing --out is replaced only with --overwrite.

The checkpoint's files are read as data (engine/safe_load.py, docs/checkpoints.md): a `.pt` file that needs more than
tensors, numbers, strings, containers and DeepSpeed's checkpoint records is refused before any file is loaded, naming
the file and the type; --trust-pickle reads a legacy checkpoint one trusts as the pickle it is (it can run code).
"""

import argparse
import copy
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ds_longstraw.engine.checkpoint_files import RunRecord, ZeroCheckpoint, load_record, resolve_tag
from ds_longstraw.models.modeling import as_dtype
from ds_longstraw.sizes import parse_bytes

PEFT_PREFIX = "base_model.model."  # a peft model's names of its base model's tensors
QLORA_MERGE = ("--merge is refused for a QLoRA run: its base weights exist only as 4-bit NF4 codes, so the merged "
               "model is either quantized again (no longer the trained model) or a dequantized base the run never "
               "trained against. Export the adapter and load it over the 4-bit base, as training did")


@dataclass
class Source:
    """One output tensor: its name in the written files, its shape and dtype there, and how to read it."""
    name: str
    shape: torch.Size
    dtype: torch.dtype
    read: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize


@dataclass
class Exported:
    out: str
    kind: str  # "model" (full fine-tune), "adapter" (peft) or "merged"
    tag_dir: str
    dtype: torch.dtype
    tensors: int
    bytes: int
    files: int
    base: str | None = None  # adapters: the base model directory


def _meta_models(record: RunRecord, dtype):
    """(base, trained) built on the meta device from the record: base is the plain transformers model the export
    writes, trained the module the checkpoint was saved from (base itself, or a peft model around another base)."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(record.model_config)
    if hasattr(config, "quantization_config"):  # QLoRA: the record's base was loaded 4-bit
        del config.quantization_config

    def build():
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=dtype)

    base = build()
    lora = record.run.lora
    if not lora.enabled:
        return base, base
    from ds_longstraw.models.lora import apply_lora

    with torch.device("meta"):
        trained = apply_lora(build(), r=lora.r, alpha=lora.alpha, dropout=lora.dropout,
                             target_modules=lora.target_modules)
    return base, trained


def _canonical_names(model) -> dict:
    """Every state-dict name of `model` -> the first name of the same tensor (a tied weight has several names;
    DeepSpeed saves it under the first, as named_parameters yields it)."""
    first, out = {}, {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        out[name] = first.setdefault(id(tensor), name)
    return out


def check_same_model(checkpoint: ZeroCheckpoint, trained, source, tag_dir, packed_frozen=False):
    """ValueError naming the parameters when the checkpoint's names and shapes are not those of `trained`.
    packed_frozen: the frozen weights are 4-bit codes (QLoRA), whose stored shapes are not the weights' shapes."""
    tensors = trained.state_dict(keep_vars=True)
    expected = {name: torch.Size(tensors[name].shape) for name, canonical in _canonical_names(trained).items()
                if name == canonical}
    have = checkpoint.shapes
    missing = [n for n in expected if n not in have]
    extra = [n for n in have if n not in expected]
    differ = [f"{n} {tuple(have[n])} in the checkpoint, {tuple(expected[n])} in the model" for n in expected
              if n in have and have[n] != expected[n] and not (packed_frozen and n not in checkpoint.trainable)]
    if missing or extra or differ:
        def some(names):
            return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")

        parts = [f"{label}: {some(names)}" for label, names in
                 (("shapes differ", differ), ("missing from the checkpoint", missing),
                  ("not in the model", extra)) if names]
        raise ValueError(f"{tag_dir} holds another model than {source} describes; " + "; ".join(parts))


def _lora_layers(trained) -> dict:
    """Base-model module path -> peft LoRA layer, for every adapted module."""
    from peft.tuners.lora import LoraLayer

    return {name[len(PEFT_PREFIX):]: module for name, module in trained.named_modules()
            if isinstance(module, LoraLayer) and name.startswith(PEFT_PREFIX)}


def _merged_weight(checkpoint, layer, path, weight, adapter):
    """W + scaling * B @ A in float32 (peft's LoRA Linear.get_delta_weight, without the module)."""
    from peft.tuners.lora import Linear

    if not isinstance(layer, Linear) or layer.use_dora.get(adapter, False):
        raise ValueError(f"--merge: {path} is a {type(layer).__name__} LoRA layer (or DoRA); only plain linear "
                         "layers are merged here")
    a = checkpoint.tensor(f"{PEFT_PREFIX}{path}.lora_A.{adapter}.weight").float()
    b = checkpoint.tensor(f"{PEFT_PREFIX}{path}.lora_B.{adapter}.weight").float()
    delta = b @ a
    if layer.fan_in_fan_out:
        delta = delta.T
    return weight.float() + delta * layer.scaling[adapter]


def _base_sources(checkpoint, base, trained, merge) -> list:
    """The tensors transformers saves of `base` (tied copies dropped, dtypes as `base` holds them), read from a
    checkpoint of `trained`: base itself, or a peft model (its base weights, merged with the adapters)."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    kept = remove_tied_weights_from_state_dict(base.state_dict(), base)
    canonical = _canonical_names(trained)
    layers = _lora_layers(trained) if trained is not base else {}
    adapter = getattr(trained, "active_adapter", None)
    out = []
    for name, meta in kept.items():
        path, _, leaf = name.rpartition(".")
        if trained is base:
            source = name
        elif path in layers:
            source = f"{PEFT_PREFIX}{path}.base_layer.{leaf}"
        else:
            source = PEFT_PREFIX + name
        source = canonical[source]
        if merge and path in layers and leaf == "weight":
            def read(source=source, path=path):
                return _merged_weight(checkpoint, layers[path], path, checkpoint.tensor(source), adapter)
        else:
            def read(source=source):
                return checkpoint.tensor(source)
        out.append(Source(name, torch.Size(meta.shape), meta.dtype, read))
    return out


def _adapter_sources(checkpoint, trained, dtype) -> list:
    """peft's adapter file: the trained LoRA tensors under the names peft saves them by (adapter name dropped)."""
    from peft import get_peft_model_state_dict

    adapter = trained.active_adapter
    out = [Source(name.replace(f".{adapter}", ""), torch.Size(p.shape), dtype,
                  lambda name=name: checkpoint.tensor(name))
           for name, p in trained.named_parameters() if p.requires_grad]
    assert {s.name for s in out} == set(get_peft_model_state_dict(trained)), "peft names its tensors otherwise"
    return out


def _write_safetensors(folder, sources, weights_name, max_bytes, revert=None):
    """Write `sources` as safetensors files of at most `max_bytes` each (one file when they fit, else
    `<stem>-0000i-of-0000n.safetensors` and the index transformers reads); one file's tensors are in memory at a
    time. revert: maps a file's {name: tensor} to the model's original checkpoint layout (transformers'
    revert_weight_conversion, say per-expert MoE weights, which serving tools expect). Returns (tensors, bytes,
    files)."""
    from safetensors.torch import save_file

    shards = [[]]
    for source in sources:
        if shards[-1] and sum(s.nbytes for s in shards[-1]) + source.nbytes > max_bytes:
            shards.append([])
        shards[-1].append(source)
    stem = weights_name[: -len(".safetensors")]
    weight_map, tensors, total = {}, 0, 0
    for index, shard in enumerate(shards, 1):
        filename = weights_name if len(shards) == 1 else f"{stem}-{index:05d}-of-{len(shards):05d}.safetensors"
        state = {s.name: s.read().to(s.dtype).contiguous() for s in shard}
        if revert is not None:
            state = revert(state)
        save_file(state, os.path.join(folder, filename), metadata={"format": "pt"})
        weight_map.update({name: filename for name in state})
        tensors += len(state)
        total += sum(t.numel() * t.element_size() for t in state.values())
        del state
    if len(shards) > 1:
        with open(os.path.join(folder, f"{stem}.safetensors.index.json"), "w") as handle:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, handle, indent=2,
                      sort_keys=True)
    return tensors, total, len(shards)


def _write_model(folder, record, base, sources, dtype, max_bytes):
    """A transformers model directory: weights, config.json (as `base` was built: architectures, dtype, use_cache
    on again for inference), generation_config.json."""
    from transformers.core_model_loading import revert_weight_conversion

    written = _write_safetensors(folder, sources, "model.safetensors", max_bytes,
                                 revert=lambda state: revert_weight_conversion(base, state))
    config = copy.deepcopy(base.config)
    config.architectures = [type(base).__name__]
    config.dtype = dtype
    config.use_cache = True  # training turns the KV cache off; generation wants it
    config.save_pretrained(folder)
    pretrained = record.run.model.pretrained
    if pretrained and os.path.isfile(os.path.join(pretrained, "generation_config.json")):
        shutil.copy(os.path.join(pretrained, "generation_config.json"), folder)  # the base's eos ids, sampling
    elif base.can_generate():
        base.generation_config.save_pretrained(folder)
    return written


def _write_tokenizer(folder, record):
    if record.tokenizer_dir is not None:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(record.tokenizer_dir).save_pretrained(folder)


def _install(tmp, out, overwrite):
    """Move the finished directory to `out` (an existing one only with overwrite, removed after the move)."""
    if os.path.lexists(out):
        if not overwrite:
            raise ValueError(f"--out {out!r} exists: pass --overwrite to replace it")
        old = tmp + ".old"
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old) if os.path.isdir(old) else os.remove(old)
    else:
        os.rename(tmp, out)


def export_checkpoint(save_dir, out, tag="latest", dtype=None, merge=False, overwrite=False,
                      max_shard_size="5GB", run_config=None, trust_pickle=False) -> Exported:
    """Export checkpoint `tag` of `save_dir` to the directory `out` (see the module docstring).

    dtype: of the written weights (default: the run's model.dtype); merge: LoRA runs only, full weights instead of
    an adapter; run_config: a run config YAML describing the model, for checkpoints without a run record;
    trust_pickle: read the checkpoint's files as any pickle (a trusted legacy checkpoint), not as data only."""
    out = os.path.abspath(os.fspath(out))
    if os.path.lexists(out) and not overwrite:
        raise ValueError(f"--out {out!r} exists: pass --overwrite to replace it")
    max_bytes = parse_bytes(max_shard_size, option="--max-shard-size")  # a bare number: bytes
    tag_dir = resolve_tag(save_dir, tag)
    record = load_record(tag_dir, run_config)
    lora = record.run.lora
    if merge and not lora.enabled:
        raise ValueError("--merge merges LoRA adapters into the base weights; this run is a full fine-tune, "
                         "whose export is full weights already")
    if merge and lora.qlora:
        raise ValueError(QLORA_MERGE)
    dtype = as_dtype(dtype or record.run.model.dtype)
    base, trained = _meta_models(record, dtype)
    checkpoint = ZeroCheckpoint(tag_dir, trust_pickle=trust_pickle)
    check_same_model(checkpoint, trained, record.source, tag_dir, packed_frozen=lora.qlora)

    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.partial-", dir=parent)
    try:
        base_dir = None
        if lora.enabled and not merge:
            kind = "adapter"
            base_dir = record.run.model.pretrained
            if base_dir is None:  # random base weights from a shape: only the checkpoint has them
                os.makedirs(os.path.join(tmp, "base"))
                _write_model(os.path.join(tmp, "base"), record, base,
                             _base_sources(checkpoint, base, trained, merge=False), dtype, max_bytes)
                base_dir = os.path.join(out, "base")
            written = _write_safetensors(tmp, _adapter_sources(checkpoint, trained, dtype),
                                         "adapter_model.safetensors", max_bytes=float("inf"))
            config = copy.deepcopy(trained.peft_config[trained.active_adapter])
            config.base_model_name_or_path = base_dir
            config.inference_mode = True
            config.save_pretrained(tmp)
        else:
            kind = "merged" if merge else "model"
            written = _write_model(tmp, record, base, _base_sources(checkpoint, base, trained, merge), dtype,
                                   max_bytes)
        _write_tokenizer(tmp, record)
        _install(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Exported(out, kind, tag_dir, dtype, *written, base=base_dir)


def _parser():
    parser = argparse.ArgumentParser(prog="longstraw export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("save_dir", help="the run's train.save_dir (DeepSpeed ZeRO-3 checkpoints)")
    parser.add_argument("--tag", default="latest", help="checkpoint tag, e.g. step200 (default: latest)")
    parser.add_argument("--out", required=True, help="the directory to write")
    parser.add_argument("--dtype", default=None, help="of the written weights: float32, bfloat16, float16 "
                                                      "(default: the run's model.dtype)")
    parser.add_argument("--merge", action="store_true", help="LoRA: merge the adapters into full weights")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="largest safetensors file: 5GB, 500MB, 2GiB or a number of bytes (default 5GB)")
    parser.add_argument("--config", default=None, help="a run config YAML describing the model, for checkpoints "
                                                       "saved without a run record (by a script of your own)")
    parser.add_argument("--trust-pickle", action="store_true",
                        help="read the checkpoint's files as any pickle, which can run code from them: only for a "
                             "legacy checkpoint you trust that holds more than data (default: data only)")
    return parser


def _shown(path):
    """A path as the user would type it: relative when it is under the current directory."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def describe(result: Exported) -> str:
    lines = [f"exported {_shown(result.tag_dir)} -> {_shown(result.out)}: {result.kind}, {result.tensors} tensors, "
             f"{result.bytes / 2**20:,.1f} MiB {str(result.dtype).replace('torch.', '')} in {result.files} "
             f"file{'s' if result.files > 1 else ''}"]
    if result.kind == "adapter":
        lines.append(f"  load: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("
                     f"{_shown(result.base)!r}), {_shown(result.out)!r})")
    else:
        lines.append(f"  load: AutoModelForCausalLM.from_pretrained({_shown(result.out)!r})")
    return "\n".join(lines)


def main(argv=None):
    args = _parser().parse_args(argv)
    try:
        result = export_checkpoint(args.save_dir, args.out, tag=args.tag, dtype=args.dtype, merge=args.merge,
                                   overwrite=args.overwrite, max_shard_size=args.max_shard_size,
                                   run_config=args.config, trust_pickle=args.trust_pickle)
    except ValueError as error:
        raise SystemExit(f"longstraw export: {error}") from None
    print(describe(result))
