"""TRL's GRPOTrainer and LongStrawGRPOTrainer on the same data, seeds and completions (tests and the example).

The completions come from a rollout_func (TRL's hook for custom generation), drawn from the prompt's tokens and
the trainer's step by a seeded generator, so that both trainers train on the same rows whatever their weights: some
end in EOS, some are cut at max_completion_length, and with `tool_masks` each has a run of "tool output" tokens
(env_mask 0). Prompts are all the same length: TRL left-pads shorter ones and runs its forward over the padding
(positions shift, the recurrent layers read pad tokens), which a transaction over the bare prompt does not.
"""

from __future__ import annotations

import contextlib
import hashlib
import os

import torch

from tests.models import float64_model

PAD, EOS, FIRST_WORD = 0, 1, 2


def tokenizer(vocab_size: int):
    """A word-level tokenizer over "w2" .. "w{vocab-1}" with <pad> = 0 and <eos> = 1 (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<eos>": EOS, **{f"w{i}": i for i in range(FIRST_WORD, vocab_size)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")


def prompts_dataset(count: int, length: int, vocab_size: int, seed: int = 0, document: int = 0):
    """`count` prompts of `length` words; with `document`, their first `document` words are the same (a document
    each prompt asks its own question of)."""
    from datasets import Dataset

    generator = torch.Generator().manual_seed(seed)
    shared = torch.randint(FIRST_WORD, vocab_size, (document,), generator=generator)
    rows = [" ".join(f"w{int(t)}" for t in torch.cat([shared, torch.randint(
        FIRST_WORD, vocab_size, (length - document,), generator=generator)])) for _ in range(count)]
    return Dataset.from_dict({"prompt": rows})


def _seed_of(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little")


def rollout_func(max_completion_length: int, vocab_size: int, tool_masks: bool = False):
    """TRL's rollout_func: each prompt's completions from (prompt, occurrence, step), not from the weights."""

    def rollout(prompts: list, trainer: object) -> dict:
        tok = trainer.processing_class
        prompt_ids, completion_ids, env_masks, seen = [], [], [], {}
        for prompt in prompts:
            ids = tok(prompt, add_special_tokens=False)["input_ids"]
            occurrence = seen[prompt] = seen.get(prompt, -1) + 1
            generator = torch.Generator().manual_seed(_seed_of(ids, occurrence, trainer.state.global_step) % 2**63)
            length = int(torch.randint(1, max_completion_length + 1, (1,), generator=generator))
            completion = torch.randint(FIRST_WORD, vocab_size, (length,), generator=generator).tolist()
            if length < max_completion_length or bool(torch.rand((), generator=generator) < 0.5):
                completion[-1] = EOS  # a finished answer; the others are cut at max_completion_length
            prompt_ids.append(ids)
            completion_ids.append(completion)
            if tool_masks:  # tokens [a, b) are a tool's output: context, not the policy's
                a = int(torch.randint(0, length, (1,), generator=generator))
                b = int(torch.randint(a, length + 1, (1,), generator=generator))
                env_masks.append([0 if a <= i < b else 1 for i in range(length)])
        out = {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}
        if tool_masks:
            out["env_mask"] = env_masks
        return out

    return rollout


def replayed(calls: list):
    """A rollout_func that returns, call by call, the (prompt ids, completion ids) another run sampled."""
    pending = list(calls)

    def rollout(prompts: list, trainer: object) -> dict:
        prompt_ids, completion_ids = pending.pop(0)
        tok = trainer.processing_class
        assert [tok(p, add_special_tokens=False)["input_ids"] for p in prompts] == [list(p) for p in prompt_ids]
        return {"prompt_ids": [list(p) for p in prompt_ids], "completion_ids": completion_ids, "logprobs": None}

    return rollout


def reward_even_words(completion_ids: list, **_: object) -> list:
    """The share of even token ids in the completion: a reward that varies within every group."""
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


def grpo_config(output_dir: str, **overrides: object):
    from trl import GRPOConfig

    settings = dict(output_dir=output_dir, per_device_train_batch_size=4, num_generations=4,
                    gradient_accumulation_steps=2, max_completion_length=6, max_steps=1, optim="sgd",
                    learning_rate=0.05, max_grad_norm=0.0,  # no clipping: it would hide a wrong loss scale
                    bf16=False, use_cpu=True, report_to=[], logging_steps=1, save_strategy="no", seed=0,
                    gradient_checkpointing=False, disable_dropout=True, beta=0.0, dataloader_num_workers=0)
    settings.update(overrides)
    return GRPOConfig(**settings)


def save_tiny_model(path: str, dtype: torch.dtype = torch.float64, seed: int = 0, vocab_size: int = 48) -> str:
    """A tiny random qwen3_5 (tests/models.py) saved as a checkpoint: TRL builds the reference from its path."""
    from tests.models import tiny_qwen3_5

    model = tiny_qwen3_5(dtype=dtype, seed=seed, vocab_size=vocab_size)
    model.config.pad_token_id, model.config.eos_token_id = PAD, EOS
    model.save_pretrained(path)
    return path


def save_tiny_glm(path: str, dtype: torch.dtype = torch.float32, seed: int = 0, vocab_size: int = 48) -> str:
    """A tiny random glm_moe_dsa (tests/glm_models.py: MLA + DSA, MoE with 6 routed experts and a dense first
    layer) saved as a checkpoint."""
    from tests.glm_models import tiny_glm_moe_dsa

    model = tiny_glm_moe_dsa(dtype=dtype, seed=seed, vocab_size=vocab_size, pad_token_id=PAD, eos_token_id=EOS)
    model.save_pretrained(path)
    return path


def train(trainer_class: type, model_path: str, output_dir: str, *, prompts: int = 4, prompt_len: int = 24,
          vocab_size: int = 48, tool_masks: bool = False, document: int = 0, dtype: torch.dtype = torch.float64,
          longstraw: dict | None = None, lora: bool = False, rollout: object = "seeded",
          on_trainer: object = None, trainer_kwargs: dict | None = None, logs: list | None = None,
          **config: object) -> dict:
    """One training run; returns the trained weights (name -> tensor on CPU). lora: a peft LoRA on the attention
    and MLP projections; the weights returned are then the adapters', before ("initial/<name>") and after.
    rollout: "seeded" (rollout_func above), a rollout_func, or None (the trainer's own generation); on_trainer:
    called with the trainer before it trains; trainer_kwargs: more constructor arguments; logs: a list that receives
    the trainer's log history (one dict per logged step)."""
    args = grpo_config(output_dir, model_init_kwargs={"dtype": dtype}, **config)
    kwargs = {} if longstraw is None else {"longstraw": longstraw}
    kwargs.update(trainer_kwargs or {})
    if rollout == "seeded":
        rollout = rollout_func(args.max_completion_length, vocab_size, tool_masks)
    if rollout is not None:
        kwargs["rollout_func"] = rollout
    if lora:
        from peft import LoraConfig

        kwargs["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
    trainer = trainer_class(model=model_path, reward_funcs=[reward_even_words], args=args,
                            train_dataset=prompts_dataset(prompts, prompt_len, vocab_size, document=document),
                            processing_class=tokenizer(vocab_size), **kwargs)
    if on_trainer is not None:
        on_trainer(trainer)
    before = _full_weights(trainer) if lora else {}
    with in_float64() if dtype == torch.float64 else contextlib.nullcontext():
        trainer.train()
    if logs is not None:
        logs.extend(trainer.state.log_history)
    after = _full_weights(trainer)
    if lora:  # the adapters alone: the base weights are frozen
        return {**{f"initial/{n}": w for n, w in before.items() if "lora_" in n},
                **{n: w for n, w in after.items() if "lora_" in n}}
    return after


class _PlainLogProbs:
    """TRL's fused LM head kernel (trl.kernels.ChunkedLogProbFunction) as plain autograd in the input's dtype: that
    kernel accumulates in float32 whatever its input, which would leave TRL's float64 run float32-accurate."""

    @staticmethod
    def apply(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
              temperature: float, chunk_size: int, softcap: float | None = None, logit_scale: float = 1.0,
              outputs: tuple = ("log_probs",)) -> tuple:
        logits = hidden @ weight.T + (0 if bias is None else bias)
        logits = logits * logit_scale
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        logp = torch.log_softmax(logits / temperature, dim=-1)
        entropy = -(logp.exp() * logp).sum(-1) if "entropy" in outputs else None
        return logp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1), entropy, None, None, None


@contextlib.contextmanager
def in_float64():
    """Both trainers in float64 end to end: transformers' qwen3_5 (tests/models.float64_model: its RMSNorms and
    delta-rule fallback compute in float32 otherwise) and TRL's LM head kernel (_PlainLogProbs)."""
    from trl.trainer import utils as trl_utils

    saved = trl_utils._ChunkedLogProbFunction
    trl_utils._ChunkedLogProbFunction = _PlainLogProbs
    try:
        with float64_model():
            yield
    finally:
        trl_utils._ChunkedLogProbFunction = saved


def _full_weights(trainer: object) -> dict:
    """The whole weights (ZeRO-3 partitions gathered; expert slices joined over their EP group) on CPU."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    if getattr(trainer, "is_deepspeed_enabled", False) and trainer.accelerator.state.deepspeed_plugin.zero_stage == 3:
        import deepspeed

        params = list(model.parameters())
        with deepspeed.zero.GatheredParameters(params):
            weights = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    else:
        weights = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    experts = getattr(trainer, "_experts", None)  # ep_size > 1: each process holds its slice (EP rank order)
    if experts is not None:
        slices = [None] * experts.ep.size
        torch.distributed.all_gather_object(slices, {n: p.detach().cpu() for n, p in experts.params.items()},
                                            group=experts.ep.process_group)
        weights.update({n: torch.cat([part[n] for part in slices]) for n in experts.params})
    return weights


def update_difference(initial: dict, ours: dict, theirs: dict) -> float:
    """|| our update - TRL's update || / || TRL's update || over every weight."""
    num = sum(float(((ours[n] - initial[n]) - (theirs[n] - initial[n])).double().pow(2).sum()) for n in initial)
    den = sum(float((theirs[n] - initial[n]).double().pow(2).sum()) for n in initial)
    return (num / den) ** 0.5 if den else float("inf")


def initial_weights(model_path: str, dtype: torch.dtype = torch.float64) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
