"""TRL's tool loop in tests: a chat tokenizer whose tool calls are single tokens, a tiny model that draws them, tools
(one that fails), an environment, and TRL's own trainer replaying another run's turns through its own tool loop.

How the loop is made to run with a random tiny model:
- the tokenizer is word level (no download) under Qwen3's chat template as TRL ships it (TRL recognises it: it
  sets Qwen3's response template for parse_response and swaps in its prefix-preserving training template); words it
  does not know (the template's tool preamble) are <unk>, and decoding is exact for the ones it knows, so
  parse_response reads the assistant header and the calls;
- each complete tool call (`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`) is one added token, so
  one sampled token is one parseable call (an add that succeeds, a divide by zero that fails, an unknown tool);
- the model (driven_model) draws those tokens and <|im_end|> (TRL's eos: the end of a turn) often: every embedding
  carries a constant in its first dimension, which dominates the final norm's output, so the LM head's first column
  acts as a per-token bias (a unigram prior: turns of a few words, half of them with calls); the LM head's other
  columns are scaled up so the context still moves every logit. Sampling at temperature 1 with fixed seeds then
  gives samples with no call, one, two and more, failures among them, and tool results past the budget.
"""

from __future__ import annotations

import contextlib

import torch

SPECIALS = ["<pad>", "<|im_end|>", "<|im_start|>", "<tool_call>", "</tool_call>", "<tool_response>",
            "</tool_response>", "<think>", "</think>"]
WORDS = ["<unk>", "user", "assistant", "system", "tool", "\n", " ", "\n\n", *(f"w{i}" for i in range(20)),
         *(str(i) for i in range(10))]
PLAIN_WORDS = [f"w{i}" for i in range(20)]  # what the model says besides calls and <|im_end|>


def call_token(name: str, **arguments: int) -> str:
    import json

    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


CALLS = [call_token("add", a=2, b=3), call_token("divide", a=1, b=0), call_token("search", query=7),
         call_token("count", step=2)]


def chat_tokenizer():
    """Word-level tokens with Qwen3's chat template (TRL's copy) and one added token per tool call in CALLS."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from trl.chat_template_utils import qwen3_chat_template

    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"\s+|\S+"), behavior="isolated")  # whitespace is a token
    core.decoder = decoders.Fuse()  # decode joins the tokens as they were: parse_response sees the template's text
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<|im_end|>",
                                  unk_token="<unk>")
    tok.add_special_tokens({"additional_special_tokens": SPECIALS[2:]})
    tok.add_tokens([AddedToken(call, special=False, normalized=False) for call in CALLS])
    tok.chat_template = qwen3_chat_template
    return tok


def add(a: int, b: int) -> int:
    """Adds two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def divide(a: int, b: int) -> float:
    """Divides a by b (fails for b = 0: TRL answers with the error).

    Args:
        a: The numerator.
        b: The denominator.
    """
    return a / b


class Counter:
    """An environment_factory environment: its `count` method is a tool whose result depends on the instance's own
    earlier calls (one instance per row, reset with the row's fields)."""

    def reset(self, **kwargs: object) -> None:
        self.total = len(str(kwargs.get("prompt", "")))  # the row's fields reach reset

    def count(self, step: int) -> int:
        """Adds step to the running total and returns it.

        Args:
            step: How much to add.
        """
        self.total += step
        return self.total


def driven_model(vocab_size: int, dtype: torch.dtype = torch.float64, seed: int = 0, *, eos_bias: float = 2.3,
                 call_bias: float = 1.2, context_scale: float = 10.0) -> torch.nn.Module:
    """A tiny qwen3_5 whose samples end turns and call tools often (module docstring): logit biases of eos_bias for
    <|im_end|>, call_bias for each call token, 0 for the plain words and -12 for everything else."""
    from tests.models import tiny_qwen3_5

    tok = chat_tokenizer()
    model = tiny_qwen3_5(dtype=dtype, seed=seed, vocab_size=vocab_size)
    bias = torch.full((vocab_size,), -12.0, dtype=dtype)
    bias[tok.convert_tokens_to_ids(PLAIN_WORDS)] = 0.0
    bias[tok.eos_token_id] = eos_bias
    bias[tok.convert_tokens_to_ids(CALLS)] = call_bias
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 4.0
        head = model.lm_head.weight
        head[:, 1:] *= context_scale
        # the final norm's output in dimension 0 is about sqrt(hidden) (1 + its weight): divide it out
        scale = model.config.hidden_size ** 0.5 * (1.0 + float(model.model.norm.weight[0]))
        head[:, 0] = bias / scale
    return model


def save_driven_model(path: str, dtype: torch.dtype = torch.float64) -> str:
    tok = chat_tokenizer()
    model = driven_model(len(tok), dtype=dtype)
    model.config.pad_token_id, model.config.eos_token_id = tok.pad_token_id, tok.eos_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path)
    return path


def chat_dataset(count: int, words: int = 6, seed: int = 0):
    """`count` one-message conversations of `words` plain words each (every prompt the same length)."""
    from datasets import Dataset

    generator = torch.Generator().manual_seed(seed)
    rows = [[{"role": "user", "content": " ".join(
        PLAIN_WORDS[int(i)] for i in torch.randint(0, len(PLAIN_WORDS), (words,), generator=generator))}]
        for _ in range(count)]
    return Dataset.from_dict({"prompt": rows})


def train(trainer_class: type, path: str, output_dir: str, *, tools: bool, environment: bool,
          dtype: torch.dtype = torch.float64, on_trainer: object = None, logs: list | None = None,
          trainer_kwargs: dict | None = None, **config: object) -> dict:
    """One tool-loop run on chat_dataset(4) with chat_tokenizer(): tools (add, divide) and/or the Counter
    environment; config: GRPOConfig settings (tests/trl_runs.grpo_config; `deepspeed=` a config path under
    accelerate). float64 runs both trainers in float64 end to end (trl_runs.in_float64). Returns the trained weights
    whole (ZeRO-3 partitions gathered); on_trainer, logs, trainer_kwargs: as trl_runs.train's."""
    from tests import trl_runs

    args = trl_runs.grpo_config(output_dir, model_init_kwargs={"dtype": dtype}, **config)
    kwargs = dict(trainer_kwargs or {})
    if tools:
        kwargs["tools"] = [add, divide]
    if environment:
        kwargs["environment_factory"] = Counter
    trainer = trainer_class(model=path, reward_funcs=[trl_runs.reward_even_words], args=args,
                            train_dataset=chat_dataset(4), processing_class=chat_tokenizer(), **kwargs)
    if on_trainer is not None:
        on_trainer(trainer)
    with trl_runs.in_float64() if dtype == torch.float64 else contextlib.nullcontext():
        trainer.train()
    if logs is not None:
        logs.extend(trainer.state.log_history)
    return trl_runs._full_weights(trainer)


def observation_runs(tool_mask: list) -> int:
    """How many tool-message runs (tool_mask 0) a completion holds: its turns after the first."""
    return sum(1 for i in range(len(tool_mask)) if tool_mask[i] == 0 and (i == 0 or tool_mask[i - 1] == 1))


def tool_turn_map(prompt_ids: list, completion_ids: list, tool_mask: list) -> dict:
    """prefix (prompt + completion so far, at a turn's start) -> the turns that follow it, in row order: what a
    run's _generate_single_turn calls returned, keyed as TRL's tool loop asks for them."""
    turns: dict[tuple, list] = {}
    for prompt, completion, mask in zip(prompt_ids, completion_ids, tool_mask, strict=True):
        n = len(completion)
        starts = [0] + [i for i in range(1, n + 1) if mask[i - 1] == 0 and (i == n or mask[i] == 1)]
        for start in starts:
            end = next((j for j in range(start, n) if mask[j] == 0), n)
            turns.setdefault(tuple(prompt) + tuple(completion[:start]), []).append(list(completion[start:end]))
    return turns


def replaying_trainer(batches: list, outputs: list) -> type:
    """TRL's GRPOTrainer whose generation returns, turn by turn, another run's recorded `batches` (one per _generate
    call: prompt ids, completion ids, tool mask per row); everything else, its tool loop included, is TRL's own.
    `outputs` receives what its _generate returns."""
    from trl import GRPOTrainer

    pending = list(batches)

    class Replaying(GRPOTrainer):
        def _generate(self, prompts: list) -> tuple:
            self._turns = tool_turn_map(*pending.pop(0))
            out = super()._generate(prompts)
            outputs.append(out)
            return out

        def _generate_single_turn(self, prompt_ids: list, images: object, multimodal_fields: object,
                                  num_generations: int, has_tool_images: bool = False) -> tuple:
            return [self._turns[tuple(ids)].pop(0) for ids in prompt_ids], None

    return Replaying


def recording(trainer: object, outputs: list, reused: list) -> None:
    """Record a trainer's _generate outputs and whether each group took its kept capture."""
    generate, run_groups = trainer._generate, trainer._run_groups

    def recording_generate(prompts):
        out = generate(prompts)
        outputs.append(out)
        return out

    def recording_run(groups, *rest):
        results = run_groups(groups, *rest)
        reused.extend(result.extras.get("capture_reused", False) for result in results)
        return results

    trainer._generate, trainer._run_groups = recording_generate, recording_run
