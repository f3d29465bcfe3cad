"""The run config of launch/train.py: an omegaconf structured config (typed; unknown keys are errors).

    deepspeed --num_gpus 2 launch/train.py --config configs/run/quickstart.yaml train.max_steps=5 optim.lr=1e-4

The YAML is merged onto these defaults, then command-line `key=value` overrides (omegaconf dotlist) on top.
Relative paths in the YAML are taken relative to the current directory (run from the repository root).
"""

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ds_longstraw.objective import GRPOObjective


@dataclass
class ModelConfig:
    shape: str | None = None  # YAML shape config (random weights), e.g. configs/models/tiny_qwen3_5.yaml
    pretrained: str | None = None  # or a local checkpoint directory (from_pretrained)
    dtype: str = "float32"
    seed: int = 0
    zero_init: Any = "auto"  # partition while building (ZeRO-3): auto | true | false
    attn_implementation: str = "sdpa"


@dataclass
class LoraSettings:
    enabled: bool = False
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: list[str] | None = None  # default: the family's projections (ds_longstraw.models.lora)
    qlora: bool = False  # NF4 4-bit base weights (bitsandbytes; needs enabled and model.pretrained)
    seed: int = 0


@dataclass
class DataConfig:
    # JSONL, one group per line (ds_longstraw.tools.data); with a rollout block, the prompts (unless rollout.prompts)
    path: str | None = None
    tokenizer: str | None = None  # local tokenizer directory for text records (default: model.pretrained)
    shuffle_seed: int | None = None
    groups_per_rank: int = 1


@dataclass
class OptimConfig:
    # Used when the DeepSpeed config has no "optimizer" block (then torch.optim.AdamW over the trainable params).
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8


@dataclass
class TrainConfig:
    max_steps: int = 1
    save_dir: str | None = None  # DeepSpeed checkpoints (tags "step<N>")
    save_every: int = 0  # 0: only at the end (when save_dir is set)
    resume: str | None = None  # "latest" or a tag such as step1 (from save_dir)
    metrics: str | None = None  # JSONL, one line per step (rank 0)
    samples: str | None = None  # with a rollout block: JSONL, one line per group rank 0 sampled (its responses)
    dump_params: str | None = None  # torch.save of the full (gathered) trainable parameters at the end
    # At the end, the last checkpoint exported as a transformers model (full fine-tune) or a peft adapter (LoRA)
    # directory, as `longstraw export` writes it (engine/export.py); needs save_dir. An existing directory is an
    # error at start, unless the run resumes (then the run's own earlier export is replaced).
    export_dir: str | None = None
    export_merge: bool = False  # LoRA: export the adapters merged into full weights
    # Resume and export read checkpoint files as data only (engine/safe_load.py); true reads a legacy checkpoint one
    # trusts as the pickle it is, which can run code from its files.
    trust_pickle: bool = False
    progress: bool = True


@dataclass
class RunConfig:
    deepspeed_config: str = MISSING  # DeepSpeed JSON with the "longstraw" block
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraSettings = field(default_factory=LoraSettings)
    data: DataConfig = field(default_factory=DataConfig)
    # every GRPOObjective field, checked by GRPOObjective itself (a bad value is refused naming its key)
    objective: GRPOObjective = field(default_factory=GRPOObjective)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    # Rollouts inside training (ds_longstraw.rollout.step): each step samples the groups' responses from the policy
    # and rewards them, instead of reading groups from data.path. Validated by rollout_step.parse_rollout.
    rollout: dict[str, Any] | None = None


def _check_choices(config):
    """Settings that are each valid alone but not together (and the objective's, which it checks itself)."""
    try:
        GRPOObjective(**OmegaConf.to_container(config.objective, resolve=True))
    except ValueError as error:
        raise ValueError(f"run config: objective.{error}") from None
    if config.rollout is not None:
        from ds_longstraw.rollout.step import parse_rollout

        rollout = parse_rollout(OmegaConf.to_container(config.rollout, resolve=True))
        if rollout.prompts is None and config.data.path is None:
            raise ValueError("run config: the rollout block takes its prompts from data.path (JSONL with 'prompt_ids' "
                             "or 'prompt') or from rollout.prompts (an import path): set one")
        if rollout.prompts is not None and config.data.path is not None:
            raise ValueError("run config: rollout.prompts and data.path both give prompts: set one")
    elif config.data.path is None:
        raise ValueError("run config is missing ['data.path'] (JSONL groups; or a rollout block)")
    if config.train.samples is not None and config.rollout is None:
        raise ValueError("run config: train.samples records the responses a rollout block samples: there is no "
                         "rollout block (the groups of data.path are on disk already)")
    if config.train.export_dir is not None and config.train.save_dir is None:
        raise ValueError("run config: train.export_dir exports the last checkpoint: set train.save_dir too")
    if config.train.export_merge and not config.lora.enabled:
        raise ValueError("run config: train.export_merge = true merges LoRA adapters: set lora.enabled = true "
                         "(a full fine-tune's export is full weights already)")
    if config.train.export_merge and config.lora.qlora:
        raise ValueError("run config: train.export_merge = true with lora.qlora: 4-bit base weights cannot take a "
                         "full-precision merge (longstraw export --help says why); export the adapter")
    if config.lora.qlora and not config.lora.enabled:
        raise ValueError("run config: lora.qlora = true trains adapters over 4-bit weights: set lora.enabled = true")
    if config.lora.qlora and config.model.pretrained is None:
        raise ValueError("run config: lora.qlora = true loads 4-bit weights from a checkpoint: set model.pretrained "
                         "(model.shape builds random full-precision weights)")


def load_run_config(path=None, overrides=()) -> RunConfig:
    """Defaults <- YAML at `path` <- dotlist `overrides`; ValueError naming the key on unknown keys or bad types."""
    try:
        config = OmegaConf.structured(RunConfig)
        if path is not None:
            config = OmegaConf.merge(config, OmegaConf.load(path))
        if overrides:
            config = OmegaConf.merge(config, OmegaConf.from_dotlist(list(overrides)))
        missing = sorted(OmegaConf.missing_keys(config))
        if missing:
            raise ValueError(f"run config is missing {missing}")
        _check_choices(config)
        return config
    except OmegaConfBaseException as error:
        key = getattr(error, "full_key", None)
        raise ValueError(f"run config: {'key ' + repr(key) + ': ' if key else ''}{error.msg}") from None
