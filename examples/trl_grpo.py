"""A TRL GRPO script on the transaction: two lines differ from TRL's own (marked "ds_longstraw").

    accelerate launch --use_deepspeed --num_processes 2 examples/trl_grpo.py            # 2 CPU processes, ZeRO-3
    python examples/trl_grpo.py --no-deepspeed                                           # one process, no DeepSpeed

Everything is built here, nothing is downloaded: a tiny random qwen3_5 (configs/models/tiny_qwen3_5.yaml), a
word-level tokenizer, a dataset of long prompts (--prompt words, ten "head" words first, one of them the needle), and
a reward for reading the head (reads_the_head). TRL generates the completions (transformers' generate), computes
rewards and advantages, logs and checkpoints; each optimizer step's groups run as transactions (docs/trl.md).
"""

import argparse
import json
import os
import random
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

VOCAB, PAD, EOS = 128, 0, 1


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<eos>": EOS, **{f"w{i}": i for i in range(2, VOCAB)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")


def long_prompts(count, length, seed=0):
    """Prompts of `length` words: ten "head" words first (one of them the needle), filler after; all one length."""
    from datasets import Dataset

    rng = random.Random(seed)
    rows, needles, heads = [], [], []
    for _ in range(count):
        words = [f"w{rng.randrange(2, VOCAB)}" for _ in range(length)]
        rows.append(" ".join(words))
        needles.append(words[rng.randrange(10)])
        heads.append(" ".join(words[:10]))
    return Dataset.from_dict({"prompt": rows, "needle": needles, "head": heads})


def reads_the_head(completions, needle, head, **_):
    """The share of completion words found among the prompt's ten head words, plus 1 when the first is the needle:
    a reward for reading the far start of the prompt, graded so that a random policy's groups already differ."""
    rewards = []
    for text, word, first_ten in zip(completions, needle, head, strict=True):
        words, wanted = text.split(), set(first_ten.split())
        share = sum(w in wanted for w in words) / max(len(words), 1)
        rewards.append(share + (1.0 if words[:1] == [word] else 0.0))
    return rewards


# ZeRO-3 with the "longstraw" block: the one addition a DeepSpeed user makes (a JSON file's path works alike)
DEEPSPEED_CONFIG = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto",
                    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                    "zero_allow_untested_optimizer": True,
                    "longstraw": {"prefix_grad": "exact", "capture_chunk": 1024}}


def _wait_for(path, seconds=120):
    """The other processes wait for rank 0's checkpoint (no process group exists before the trainer's)."""
    import time

    deadline = time.time() + seconds
    while not os.path.exists(path):
        if time.time() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.5)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=4096, help="prompt length in tokens")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--no-deepspeed", action="store_true", help="one process, the block as an argument")
    parser.add_argument("--output-dir", default=None)
    args = parser.parse_args()

    import torch
    from trl import GRPOConfig

    from ds_longstraw.integrations.trl import LongStrawGRPOTrainer  # ds_longstraw: instead of trl's GRPOTrainer
    from ds_longstraw.models.modeling import CONFIGS_DIR, build_model

    torch.set_num_threads(1)
    output_dir = args.output_dir or os.path.join(tempfile.gettempdir(), "trl_grpo_example")
    model = os.path.join(output_dir, "model")  # a checkpoint path, as a hub id would be (TRL loads the reference)
    if int(os.environ.get("RANK", "0")) == 0 and not os.path.isdir(model):
        built = build_model(CONFIGS_DIR / "models" / "tiny_qwen3_5.yaml", dtype="float32", seed=0)
        built.config.pad_token_id, built.config.eos_token_id = PAD, EOS
        building = f"{model}.building"
        built.save_pretrained(building)
        os.replace(building, model)  # whole or not at all, for the processes that wait for it
    _wait_for(model)
    config = GRPOConfig(
        output_dir=output_dir, per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=2,
        max_completion_length=8, learning_rate=1e-4, max_steps=args.steps, logging_steps=1, save_strategy="no",
        bf16=False, use_cpu=True, report_to=[], gradient_checkpointing=False, beta=0.04, loss_type="dapo", seed=0,
        # ds_longstraw: the DeepSpeed JSON carries the "longstraw" block (or, without DeepSpeed, longstraw= below)
        deepspeed=None if args.no_deepspeed else DEEPSPEED_CONFIG,
    )
    extra = {"longstraw": {"prefix_grad": "exact", "capture_chunk": 1024}} if args.no_deepspeed else {}
    trainer = LongStrawGRPOTrainer(model=model, reward_funcs=[reads_the_head], args=config,
                                   train_dataset=long_prompts(16, args.prompt), processing_class=tokenizer(), **extra)
    trainer.train()
    if trainer.accelerator.is_main_process:
        steps = [entry for entry in trainer.state.log_history if "reward" in entry]
        print(json.dumps({"steps": len(steps), "reward": [round(e["reward"], 4) for e in steps],
                          "loss": [e["loss"] for e in steps]}))


if __name__ == "__main__":
    main()
