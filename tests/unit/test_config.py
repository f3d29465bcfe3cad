"""Configuration at the door: ds_longstraw.initialize validates the DeepSpeed config's "longstraw" block (and the
DeepSpeed keys grpo_step relies on) BEFORE any work: no process group, no partitioning. Errors are ValueErrors that
name the key. The shipped configs (configs/) all pass, and the run config (omegaconf) rejects unknown keys.
"""

import json
import os

import pytest
import torch
from models import tiny_qwen3_5

import ds_longstraw
from ds_longstraw.engine.config import near_miss_block_names, read_block
from ds_longstraw.engine.run_config import load_run_config
from ds_longstraw.models.modeling import config_from_shape, parameter_count

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ds(**block):
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 3}, "longstraw": {"enabled": True, **block}}


BAD = {
    # name: (config, words the message must contain)
    "typo-key": (_ds(capture_chunks=8), ["longstraw.capture_chunks"]),
    "negative-chunk": (_ds(capture_chunk=-4), ["longstraw.capture_chunk", "-4"]),
    "zero-replay-block": (_ds(replay_block=0), ["longstraw.replay_block"]),
    "zero-member-span-capture": (_ds(member_span_capture=0), ["longstraw.member_span_capture"]),
    "unknown-prefix-grad": (_ds(prefix_grad="exactly"), ["longstraw.prefix_grad", "exactly"]),
    "nested-typo": (_ds(offload={"teir": "cpu"}), ["longstraw.offload.teir"]),
    "block-not-a-dict": ({**_ds(), "longstraw": "on"}, ["longstraw"]),
    "near-miss-underscore": ({**{k: v for k, v in _ds().items() if k != "longstraw"}, "long_straw": {}},
                             ["long_straw", "did you mean 'longstraw'"]),
    "near-miss-camel": ({**_ds(), "longStraw": {"capture_chunk": 8}}, ["longStraw", "did you mean"]),
    "near-miss-dash": ({"long-straw": {}, "zero_optimization": {"stage": 3}}, ["long-straw"]),
    "near-miss-typo": ({"longstraww": {}, "zero_optimization": {"stage": 3}}, ["longstraww"]),
    "accumulation": ({**_ds(), "gradient_accumulation_steps": 4}, ["gradient_accumulation_steps", "4"]),
    "zero-stage-0": ({**_ds(), "zero_optimization": {"stage": 0}}, ["zero_optimization.stage", "0"]),
    "zero-prefix-block": (_ds(prefix_grad="exact", prefix_block=0), ["longstraw.prefix_block", "0"]),
    "unknown-keep-graph": (_ds(prefix_grad="exact", prefix_keep_graph="sometimes"),
                           ["longstraw.prefix_keep_graph", "sometimes"]),
    "negative-graph-budget": (_ds(prefix_grad="exact", prefix_graph_budget_gb=-1),
                              ["longstraw.prefix_graph_budget_gb"]),
    "graph-budget-without-fits": (_ds(prefix_grad="exact", prefix_keep_graph=True, prefix_graph_budget_gb=2),
                                  ["longstraw.prefix_graph_budget_gb", "prefix_keep_graph"]),
    "kept-attention-nvme-without-path": (_ds(prefix_grad="exact", prefix_keep_attention=True,
                                             offload={"kept_attention_tier": "nvme"}),
                                         ["longstraw.offload", "nvme_path", "kept_attention_tier"]),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_config_fails_at_initialize_naming_the_key(name):
    config, words = BAD[name]
    with pytest.raises(ValueError) as error:
        ds_longstraw.initialize(model=tiny_qwen3_5(torch.float32), config=config)
    for word in words:
        assert word in str(error.value), str(error.value)
    assert not torch.distributed.is_initialized()  # failed before any work


def test_bad_config_from_a_json_path(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_ds(prefix_grad="approximate")))
    for config in (path, str(path)):  # a pathlib.Path works too (deepspeed.initialize takes str only)
        with pytest.raises(ValueError, match="longstraw.prefix_grad"):
            ds_longstraw.initialize(model=tiny_qwen3_5(torch.float32), config=config)


def test_bad_config_through_args_deepspeed_config(tmp_path):
    import argparse

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_ds(page_tokens=-1)))
    with pytest.raises(ValueError, match="longstraw.page_tokens"):
        ds_longstraw.initialize(args=argparse.Namespace(deepspeed_config=str(path), local_rank=-1),
                                model=tiny_qwen3_5(torch.float32))


def test_unsupported_architecture_fails_at_initialize():
    with pytest.raises(ValueError, match="unsupported architecture"):
        ds_longstraw.initialize(model=torch.nn.Linear(2, 2), config=_ds())


def test_missing_block_means_defaults_and_implied_accumulation_is_checked():
    longstraw = read_block({"zero_optimization": {"stage": 3}})
    assert longstraw.enabled and longstraw.prefix_grad == "detached"
    with pytest.raises(ValueError, match="train_batch_size"):
        read_block({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}},
                   world_size=2)
    read_block({"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}},
               world_size=2)


def test_disabled_block_skips_engine_checks():
    assert not read_block({"longstraw": {"enabled": False}, "zero_optimization": {"stage": 0}}).enabled


def test_near_miss_leaves_real_deepspeed_keys_alone():
    keys = {"train_batch_size": 1, "zero_optimization": {}, "bf16": {}, "optimizer": {}, "scheduler": {},
            "gradient_clipping": 1.0, "steps_per_print": 10, "wall_clock_breakdown": False, "data_types": {},
            "load_universal_checkpoint": False, "longstraw": {}}
    assert near_miss_block_names(keys) == []


@pytest.mark.parametrize("name", sorted(os.listdir(os.path.join(REPO, "configs", "deepspeed"))))
def test_shipped_deepspeed_configs_are_valid(name):
    with open(os.path.join(REPO, "configs", "deepspeed", name)) as handle:
        config = json.load(handle)
    longstraw = read_block(config)
    assert "longstraw" in config and longstraw.enabled and config["zero_optimization"]["stage"] == 3


@pytest.mark.parametrize("name", sorted(os.listdir(os.path.join(REPO, "configs", "run"))))
def test_shipped_run_configs_load(name):
    run = load_run_config(os.path.join(REPO, "configs", "run", name))
    assert os.path.exists(os.path.join(REPO, run.deepspeed_config))
    assert (run.model.shape is None) != (run.model.pretrained is None)


def test_run_config_rejects_unknown_keys_and_bad_types():
    path = os.path.join(REPO, "configs", "run", "quickstart.yaml")
    with pytest.raises(ValueError, match="train.max_stepz"):
        load_run_config(path, ["train.max_stepz=3"])
    with pytest.raises(ValueError, match="train.max_steps"):
        load_run_config(path, ["train.max_steps=many"])
    with pytest.raises(ValueError, match="data.path"):
        load_run_config(None, ["deepspeed_config=x.json"])
    assert load_run_config(path, ["train.max_steps=7", "optim.lr=0.5"]).train.max_steps == 7


def test_run_config_takes_every_objective_field_and_names_a_bad_one():
    """The objective block is GRPOObjective's fields, checked by GRPOObjective (the error names objective.<key>)."""
    from dataclasses import fields

    from ds_longstraw import GRPOObjective

    path = os.path.join(REPO, "configs", "run", "quickstart.yaml")
    run = load_run_config(path, ["objective.entropy_coef=0.01", "objective.clip_ratio_c=3.0",
                                 "objective.loss_agg=seq-mean-token-sum-norm", "objective.norm_length=512",
                                 "objective.rollout_correction=sequence_mask", "objective.loss_scope=rank"])
    objective = GRPOObjective(**run.objective)
    assert (objective.entropy_coef, objective.norm_length, objective.loss_scope) == (0.01, 512, "rank")
    assert set(run.objective) == {f.name for f in fields(GRPOObjective)}
    for override, key in (("objective.kl_estimator=k5", "objective.kl_estimator"),
                          ("objective.loss_agg=seq-mean-token-sum-norm", "objective.loss_agg"),
                          ("objective.entropy_coeff=0.1", "objective.entropy_coeff")):
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            load_run_config(path, [override])


def test_run_config_qlora_needs_adapters_and_a_checkpoint():
    path = os.path.join(REPO, "configs", "run", "quickstart.yaml")
    with pytest.raises(ValueError, match="lora.enabled"):
        load_run_config(path, ["lora.qlora=true"])
    with pytest.raises(ValueError, match="model.pretrained"):
        load_run_config(path, ["lora.qlora=true", "lora.enabled=true"])
    run = load_run_config(path, ["lora.qlora=true", "lora.enabled=true", "model.shape=null", "model.pretrained=/ckpt"])
    assert run.lora.qlora and run.model.pretrained == "/ckpt"


def test_model_from_a_local_checkpoint_directory(tmp_path):
    from ds_longstraw.models.modeling import build_model

    model = tiny_qwen3_5(torch.float32, seed=2)
    model.save_pretrained(tmp_path / "ckpt")
    loaded = build_model(pretrained=str(tmp_path / "ckpt"), dtype="float32")
    assert type(loaded) is type(model)
    for (name, a), (_, b) in zip(model.named_parameters(), loaded.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="not a local directory"):
        build_model(pretrained=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="exactly one"):
        build_model()
    with pytest.raises(ValueError, match="zero_optimization.stage = 3"):
        build_model(shape=os.path.join(REPO, "configs", "models", "tiny_qwen3_5.yaml"), zero_init=True,
                    ds_config={"zero_optimization": {"stage": 2}})


def test_model_shapes():
    """Qwen3.6-27B: hidden 5120, 64 layers (every 4th full attention: 48 GDN + 16 attention), 24 Q / 4 KV heads
    of 256, GDN 16 QK / 48 V heads of 128, conv 4; counted on the meta device (nothing allocated)."""
    big = config_from_shape(os.path.join(REPO, "configs", "models", "qwen3_6_27b.yaml"))
    assert (big.hidden_size, big.num_hidden_layers, big.num_attention_heads, big.num_key_value_heads,
            big.head_dim) == (5120, 64, 24, 4, 256)
    assert (big.linear_num_key_heads, big.linear_num_value_heads, big.linear_key_head_dim,
            big.linear_value_head_dim, big.linear_conv_kernel_dim) == (16, 48, 128, 128, 4)
    assert big.layer_types.count("full_attention") == 16 and big.layer_types[3] == "full_attention"
    assert 26e9 < parameter_count(big) < 28e9
    for name in ("tiny_qwen3_5.yaml", "small_qwen3_5.yaml"):
        small = config_from_shape(os.path.join(REPO, "configs", "models", name))
        assert small.layer_types[3] == "full_attention" and small.layer_types[0] == "linear_attention"


def test_glm_5_2_shape_config_builds_its_transformers_config():
    """configs/models/glm_5_2.yaml is a real glm_moe_dsa config whose retained bytes per token match
    mission/NUMBERS.md: 78 x (512 + 64) x 2 B of latent + 21 x 128 x 2 B of indexer keys = 95,232 B."""
    from ds_longstraw.models.modeling import config_from_shape

    config = config_from_shape("configs/models/glm_5_2.yaml")
    assert config.model_type == "glm_moe_dsa"
    full = sum(kind == "full" for kind in config.indexer_types)
    assert (config.num_hidden_layers, full) == (78, 21)
    per_token = (config.num_hidden_layers * (config.kv_lora_rank + config.qk_rope_head_dim) * 2
                 + full * config.index_head_dim * 2)
    assert per_token == 95_232


def test_graph_budget_follows_its_settings():
    """prefix_keep_graph / prefix_graph_budget_gb as offload/auto.graph_budget reads them: none in detached mode or
    with False, no bound with True, the given GiB, else a quarter of what the rank may still take."""
    from ds_longstraw.offload.auto import KEEP_GRAPH_FRACTION, graph_budget

    gib = 1 << 30
    assert graph_budget("fits", None, "detached", 8 * gib) == 0
    assert graph_budget(False, None, "exact", 8 * gib) == 0
    assert graph_budget(True, None, "exact", None) is None
    assert graph_budget("fits", 0.5, "exact", None) == gib // 2
    assert graph_budget("fits", 0, "exact", 8 * gib) == 0
    assert graph_budget("fits", None, "exact", 8 * gib) == int(KEEP_GRAPH_FRACTION * 8 * gib) == 2 * gib
    with pytest.raises(ValueError, match="may still take"):
        graph_budget("fits", None, "exact", None)
