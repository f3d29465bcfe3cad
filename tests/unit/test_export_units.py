"""`longstraw export` on one-rank ZeRO-3 checkpoints (tests/dist_scripts/one_rank_checkpoints.py, one subprocess of
~15 s): what each run becomes, and the errors at the door.

  formats:  full fine-tune -> transformers directory (+ tokenizer) == the trained module's parameters, bit for bit;
            glm_moe_dsa -> its experts written per expert (transformers' original layout) and loaded back equal;
            LoRA over shape weights -> peft adapter + the base in out/base, == the trained module's logits;
            --merge == to float32 rounding; --dtype bfloat16 == the float32 tensors cast.
  errors:   a missing tag, no 'latest', a checkpoint of another model (names and shapes named), no run record
            (--config describes the model instead), an existing --out (refused; --overwrite replaces), --merge of a
            full fine-tune or of a QLoRA run; a failure part-way leaves neither --out nor a temporary directory.
  data:     the checkpoints' files hold data and DeepSpeed's records only (what the allow-list is read from); a
            file crafted to run a command when unpickled (the model-state or optimizer-state file, or an expert-slice
            file) is refused by `longstraw export` naming the file and the type, and the command never runs;
            --trust-pickle reads a trusted legacy file; expert slices are read as data even then.
The 2-rank launcher runs and their exports loaded without ds_longstraw are tests/launcher/test_export.py (slow).
"""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from crafted_checkpoints import RunsCommand, add_entry, copy_tag, legacy_entry
from dist_scripts.launching import REPO, free_port
from omegaconf import OmegaConf

from ds_longstraw.engine.export import export_checkpoint, main
from ds_longstraw.engine.run_config import load_run_config
from ds_longstraw.engine.safe_load import check_tag, deepspeed_globals, load_data, tag_files
from ds_longstraw.sizes import parse_bytes

SHAPES = os.path.join(REPO, "configs", "models")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one_rank")
    script = os.path.join(REPO, "tests", "dist_scripts", "one_rank_checkpoints.py")
    result = subprocess.run([sys.executable, script, str(tmp), str(free_port())], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return tmp


def _copy(ckpts, run, tmp_path):
    """A copy of a run's save_dir to break."""
    shutil.copytree(ckpts / run, tmp_path / run)
    return tmp_path / run


def _load(path, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)


def _logits(model):
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, 29))
    with torch.no_grad():
        return model.eval()(input_ids=ids, use_cache=False).logits[0]


def test_full_fine_tune_is_the_trained_module_with_its_tokenizer(ckpts, tmp_path):
    from transformers import AutoTokenizer

    result = export_checkpoint(ckpts / "full", tmp_path / "out")
    assert result.kind == "model" and result.files == 1
    loaded = dict(_load(tmp_path / "out").named_parameters())
    trained = torch.load(ckpts / "full.pt")
    assert set(loaded) == set(trained)
    for name, tensor in trained.items():
        assert torch.equal(loaded[name], tensor), name
    assert AutoTokenizer.from_pretrained(tmp_path / "out")("t5 t9").input_ids == [5, 9]
    with open(tmp_path / "out" / "config.json") as handle:
        config = json.load(handle)
    assert config["architectures"] and config["dtype"] == "float32" and config["use_cache"] is True


def test_moe_experts_are_written_per_expert_and_load_back(ckpts, tmp_path):
    from safetensors import safe_open

    export_checkpoint(ckpts / "glm", tmp_path / "out")
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as handle:
        names = list(handle.keys())
    assert any(".experts.0." in name for name in names)  # transformers' original (serving) layout
    loaded = dict(_load(tmp_path / "out", experts_implementation="eager").named_parameters())
    for name, tensor in torch.load(ckpts / "glm.pt").items():
        assert torch.equal(loaded[name], tensor), name


def _trained_lora(ckpts):
    from ds_longstraw.models.lora import apply_lora
    from ds_longstraw.models.modeling import build_model

    model = apply_lora(build_model(shape=os.path.join(SHAPES, "tiny_qwen3_5.yaml"), seed=0), r=4, alpha=32, seed=0)
    model.load_state_dict(torch.load(ckpts / "lora.pt"))
    return model


def test_lora_over_shape_weights_is_an_adapter_with_its_base(ckpts, tmp_path):
    from peft import PeftModel

    result = export_checkpoint(ckpts / "lora", tmp_path / "out")
    assert result.kind == "adapter" and result.base == str(tmp_path / "out" / "base")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(tmp_path / "out"))
    want = _logits(_trained_lora(ckpts))
    got = _logits(PeftModel.from_pretrained(_load(result.base), tmp_path / "out"))
    assert torch.equal(got, want)


def test_merged_lora_matches_the_adapters_to_float32_rounding(ckpts, tmp_path):
    export_checkpoint(ckpts / "lora", tmp_path / "out", merge=True)
    got, want = _logits(_load(tmp_path / "out")), _logits(_trained_lora(ckpts))
    # one float32 rounding of W + s * B @ A against the adapter path's separate products: measured 1.7e-7
    assert (got - want).abs().max() <= 1e-6
    assert not any("lora" in name for name, _ in _load(tmp_path / "out").named_parameters())


def test_dtype_casts_the_weights(ckpts, tmp_path):
    from safetensors import safe_open

    export_checkpoint(ckpts / "full", tmp_path / "out", dtype="bfloat16")
    trained = torch.load(ckpts / "full.pt")
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as handle:
        for name in handle.keys():
            assert torch.equal(handle.get_tensor(name), trained[name].to(torch.bfloat16)), name
    with open(tmp_path / "out" / "config.json") as handle:
        assert json.load(handle)["dtype"] == "bfloat16"


def test_missing_tag_names_the_tags_there(ckpts, tmp_path):
    with pytest.raises(ValueError, match=r"tag 'step7' is not a checkpoint .*\['step1'\]"):
        export_checkpoint(ckpts / "full", tmp_path / "out", tag="step7")
    assert not os.path.exists(tmp_path / "out")


def test_no_latest_file_asks_for_a_tag(ckpts, tmp_path):
    save_dir = _copy(ckpts, "full", tmp_path)
    os.remove(save_dir / "latest")
    with pytest.raises(ValueError, match=r"no 'latest' file; pass --tag, one of \['step1'\]"):
        export_checkpoint(save_dir, tmp_path / "out")
    export_checkpoint(save_dir, tmp_path / "out", tag="step1")


def _run_config(tmp_path, shape, name="run.yaml"):
    run = load_run_config(None, ["deepspeed_config=ds.json", "data.path=groups.jsonl", f"model.shape={shape}"])
    OmegaConf.save(run, tmp_path / name)
    return tmp_path / name


def test_checkpoint_of_another_model_names_the_parameters(ckpts, tmp_path):
    fields = OmegaConf.load(os.path.join(SHAPES, "tiny_qwen3_5.yaml"))
    fields.intermediate_size = 96
    OmegaConf.save(fields, tmp_path / "wider.yaml")
    with pytest.raises(ValueError, match=r"holds another model .*shapes differ: model\.layers\.0\.mlp\.\w+\.weight "
                                         r"\(80, 48\) in the checkpoint, \(96, 48\) in the model"):
        export_checkpoint(ckpts / "full", tmp_path / "out", run_config=_run_config(tmp_path, tmp_path / "wider.yaml"))
    glm = _run_config(tmp_path, os.path.join(SHAPES, "tiny_glm_moe_dsa.yaml"), "glm.yaml")
    with pytest.raises(ValueError, match=r"missing from the checkpoint: .* and \d+ more; not in the model: "):
        export_checkpoint(ckpts / "full", tmp_path / "out", run_config=glm)
    assert sorted(os.listdir(tmp_path)) == ["glm.yaml", "run.yaml", "wider.yaml"]  # no --out, no partial one


def test_checkpoint_without_a_record_takes_a_run_config(ckpts, tmp_path):
    save_dir = _copy(ckpts, "full", tmp_path)
    shutil.rmtree(save_dir / "step1" / "longstraw")
    with pytest.raises(ValueError, match=r"no run record .*--config run\.yaml"):
        export_checkpoint(save_dir, tmp_path / "out")
    run = _run_config(tmp_path, os.path.join(SHAPES, "tiny_qwen3_5.yaml"))
    export_checkpoint(save_dir, tmp_path / "out", run_config=run)
    loaded = dict(_load(tmp_path / "out").named_parameters())
    for name, tensor in torch.load(ckpts / "full.pt").items():
        assert torch.equal(loaded[name], tensor), name


def test_existing_out_is_refused_unless_overwrite(ckpts, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="exists: pass --overwrite"):
        export_checkpoint(ckpts / "full", tmp_path / "out")
    assert os.listdir(tmp_path / "out") == ["keep.txt"]
    export_checkpoint(ckpts / "full", tmp_path / "out", overwrite=True)
    assert "keep.txt" not in os.listdir(tmp_path / "out") and "model.safetensors" in os.listdir(tmp_path / "out")
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_a_failure_part_way_leaves_no_files(ckpts, tmp_path, monkeypatch):
    import ds_longstraw.engine.export as export

    def fail(*args):
        raise RuntimeError("disk full")

    monkeypatch.setattr(export, "_write_tokenizer", fail)  # after the weights are written
    with pytest.raises(RuntimeError, match="disk full"):
        export_checkpoint(ckpts / "full", tmp_path / "new")
    assert os.listdir(tmp_path) == []
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "keep.txt").write_text("mine")
    with pytest.raises(RuntimeError, match="disk full"):
        export_checkpoint(ckpts / "full", tmp_path / "old", overwrite=True)
    assert os.listdir(tmp_path) == ["old"] and os.listdir(tmp_path / "old") == ["keep.txt"]


def test_merge_is_refused_for_a_full_fine_tune_and_for_qlora(ckpts, tmp_path):
    with pytest.raises(ValueError, match="this run is a full fine-tune"):
        export_checkpoint(ckpts / "full", tmp_path / "out", merge=True)
    save_dir = _copy(ckpts, "lora", tmp_path)
    record = save_dir / "step1" / "longstraw" / "run.yaml"
    run = OmegaConf.load(record)
    run.lora.qlora, run.model.pretrained, run.model.shape = True, str(tmp_path), None
    OmegaConf.save(run, record)
    with pytest.raises(ValueError, match="refused for a QLoRA run: its base weights exist only as 4-bit NF4 codes"):
        export_checkpoint(save_dir, tmp_path / "out", merge=True)
    assert not os.path.exists(tmp_path / "out")


def test_command_line(ckpts, tmp_path, capsys):
    main([str(ckpts / "full"), "--out", str(tmp_path / "out"), "--max-shard-size", "64KB"])
    said = capsys.readouterr().out
    assert "model, 56 tensors" in said and "AutoModelForCausalLM.from_pretrained(" in said
    assert len([f for f in os.listdir(tmp_path / "out") if f.endswith(".safetensors")]) > 1
    with pytest.raises(SystemExit, match="longstraw export: --out .* exists"):
        main([str(ckpts / "full"), "--out", str(tmp_path / "out")])


def test_max_shard_size_is_bytes(tmp_path):
    """--max-shard-size reads ds_longstraw.sizes.parse_bytes with a bare number counting bytes; a bad size is a
    ValueError naming the option, raised before the checkpoint is read (there is none here) or anything written."""
    assert [parse_bytes(s, option="--max-shard-size") for s in ("5GB", "200MB", "64KB", "1.5gb", 1000, "12")] == [
        5 * 10**9, 200 * 10**6, 64000, 1.5 * 10**9, 1000, 12]
    with pytest.raises(ValueError, match="--max-shard-size '5 gigs' is not a size in bytes"):
        export_checkpoint(tmp_path / "no-run", tmp_path / "out", max_shard_size="5 gigs")
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("overrides, words", [
    (["train.export_dir=out"], ["train.export_dir", "train.save_dir"]),
    (["train.save_dir=c", "train.export_dir=out", "train.export_merge=true"], ["export_merge", "lora.enabled"]),
    (["train.save_dir=c", "train.export_merge=true", "lora.enabled=true", "lora.qlora=true",
      "model.pretrained=p", "model.shape=null"], ["export_merge", "qlora"]),
], ids=["export-without-save-dir", "merge-full-fine-tune", "merge-qlora"])
def test_run_config_export_settings_at_the_door(overrides, words):
    with pytest.raises(ValueError) as error:
        load_run_config(None, ["deepspeed_config=ds.json", "data.path=g.jsonl", "model.shape=s.yaml", *overrides])
    for word in words:
        assert word in str(error.value)


# -- checkpoints are data (engine/safe_load.py) -----------------------------------------------------------------
MODEL_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"
OPTIM_STATES = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


def test_real_checkpoints_hold_data_and_deepspeed_records_only(ckpts):
    """Where the allow-list comes from: beyond torch's data-only defaults, the `.pt` files of the three runs (full,
    LoRA, glm_moe_dsa; model and optimizer states) name only ZeroStageEnum and LossScaler (every optimizer-state
    file's "zero_stage" and "loss_scaler"), and every tag passes the check."""
    beyond = set()
    for run in ("full", "lora", "glm"):
        files = tag_files(ckpts / run / "step1")
        assert [os.path.basename(f) for f in files] == [MODEL_STATES, OPTIM_STATES]
        for path in files:
            beyond |= set(torch.serialization.get_unsafe_globals_in_checkpoint(path))
        check_tag(ckpts / run / "step1")
    assert beyond == {"deepspeed.runtime.zero.config.ZeroStageEnum", "deepspeed.runtime.fp16.loss_scaler.LossScaler"}


def test_fp16_loss_scaler_reads_back(tmp_path):
    """The one allowed type no CPU checkpoint holds (DeepSpeed refuses fp16 on CPU): ZeRO-3 stores its
    DynamicLossScaler as "loss_scaler" under fp16. It reads back whole, its dtype included."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    scaler = DynamicLossScaler(2.0**16, 1000, 1, 2, False, dtype=torch.float16)
    torch.save({"loss_scaler": scaler}, tmp_path / "optim.pt")
    assert vars(load_data(tmp_path / "optim.pt", deepspeed_globals())["loss_scaler"]) == vars(scaler)


def _crafted(ckpts, tmp_path, victim, entry):
    """A copy of the full run's checkpoint (save_dir tmp_path/ckpt) with `entry` added to its file `victim`."""
    tag = copy_tag(ckpts / "full", "step1", tmp_path / "ckpt")
    add_entry(os.path.join(tag, victim), "extra", entry)
    return tmp_path / "ckpt", os.path.join(tag, victim)


def test_longstraw_export_refuses_a_file_that_would_run_code(ckpts, tmp_path):
    """The issue's attack on the installed command: one more entry in the rank-0 model-state file, an object whose
    unpickling runs a shell command (here: touch a marker). Without the check the command ran and the export
    exited 0; now it is refused, naming the file and the type, the marker never appears and nothing is written."""
    marker = tmp_path / "MARKER"
    save_dir, victim = _crafted(ckpts, tmp_path, MODEL_STATES, RunsCommand(marker))
    command = os.path.join(os.path.dirname(sys.executable), "longstraw")
    result = subprocess.run([command, "export", str(save_dir), "--out", str(tmp_path / "out")], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 1, result.stderr[-2000:]
    assert f"longstraw export: {victim}: refused before loading: it needs type posix.system" in result.stderr
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_every_file_is_checked_before_any_is_loaded(ckpts, tmp_path):
    """The same entry in the optimizer-state file (read last by DeepSpeed's parser, first by the old code)."""
    marker = tmp_path / "MARKER"
    save_dir, victim = _crafted(ckpts, tmp_path, OPTIM_STATES, RunsCommand(marker))
    with pytest.raises(SystemExit, match=re.escape(f"{victim}: refused before loading: it needs type posix.system")):
        main([str(save_dir), "--out", str(tmp_path / "out")])
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_trust_pickle_reads_a_trusted_legacy_file(ckpts, tmp_path):
    """A harmless object outside the allow-list (argparse.Namespace in the optimizer-state file) stands for a
    legacy file: refused, naming its type and the opt-in; --trust-pickle exports it, the trained weights bit for
    bit. The run config's key for resume and train.export_dir is train.trust_pickle (default false)."""
    save_dir, victim = _crafted(ckpts, tmp_path, OPTIM_STATES, legacy_entry())
    with pytest.raises(SystemExit, match=re.escape(f"{victim}: refused before loading: it needs type "
                                                   "argparse.Namespace") + ".*--trust-pickle"):
        main([str(save_dir), "--out", str(tmp_path / "out")])
    main([str(save_dir), "--out", str(tmp_path / "out"), "--trust-pickle"])
    loaded = dict(_load(tmp_path / "out").named_parameters())
    for name, tensor in torch.load(ckpts / "full.pt").items():
        assert torch.equal(loaded[name], tensor), name
    base = ["deepspeed_config=ds.json", "data.path=g.jsonl", "model.shape=s.yaml"]
    assert load_run_config(None, base).train.trust_pickle is False
    assert load_run_config(None, [*base, "train.trust_pickle=true"]).train.trust_pickle is True


def test_expert_slices_are_read_as_data_even_with_trust_pickle(ckpts, tmp_path):
    """An expert-slice file (the project's own format: tensors, numbers, strings) that would run code, beside the
    glm run's shards: the tag check names it; --trust-pickle, which trusts DeepSpeed's files, does not reach the
    project's own: the slice reader refuses it too. (Real EP slice files: tests/launcher/test_engine.py.)"""
    marker = tmp_path / "MARKER"
    tag = copy_tag(ckpts / "glm", "step1", tmp_path / "ckpt")
    victim = os.path.join(tag, "experts_ep2_rank0.pt")
    torch.save({"ep_size": 2, "experts": (0, 2), "extra": RunsCommand(marker)}, victim)
    for trust in ([], ["--trust-pickle"]):
        with pytest.raises(SystemExit, match=re.escape(f"{victim}: refused before loading: it needs type "
                                                       "posix.system")):
            main([str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), *trust])
    assert not marker.exists() and not (tmp_path / "out").exists()
