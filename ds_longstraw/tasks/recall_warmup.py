"""The recall task's supervised warm-up: plain PyTorch, cross-entropy on the answer token only.

GRPO from a random policy does not find the lookup (the kv task's lesson: the reward stays at the level of a
random record for 1,000+ steps). The warm-up trains the policy at a SHORT prompt length until it retrieves
there; GRPO then runs at a longer length, where the warm-up's accuracy has dropped. This is the one place the
model trains outside the engine: a transformers forward, a cross-entropy on the last position, AdamW.

`warm_up` is deterministic given its arguments (prompts from stream `seed`, weights from `seed`); `cached`
builds the checkpoint once into a directory (save_pretrained) and reuses it afterwards. Nothing is downloaded.
The task is a module with recall's `batch(seed, first, count, **sizes)` (recall by default; tasks/reread.py too).
"""

import hashlib
import json
import math
import time
from pathlib import Path

import torch

from ds_longstraw.models.modeling import MODELS_DIR
from ds_longstraw.tasks import recall

# The model the recall tasks' warm-ups build (recall_demo's, reread's and reread_hint's)
SHAPE = MODELS_DIR / "recall_qwen3_5.yaml"
# Held-out evaluation prompts come from streams far from any training seed; the warm-up and GRPO measure the same
# EVAL_PROMPTS prompts per length, so their accuracies compare (one prompt is 1/256 = 0.004).
EVAL_SEED = 10_000
EVAL_PROMPTS = 256


def held_out(sizes, lengths, count=EVAL_PROMPTS, task=recall) -> dict:
    """{length: (prompts, answers)}: `count` held-out prompts of `task` per length, its other sizes from `sizes`."""
    return {n: task.batch(EVAL_SEED, 0, count, **{**sizes, "prompt_tokens": n}) for n in lengths}


def evaluate(model, sets) -> dict:
    """{length: greedy exact-match accuracy} on `held_out`'s sets, in eval mode; the model's mode is restored."""
    was = model.training
    model.eval()
    out = {n: recall.accuracy(model, *batch) for n, batch in sets.items()}
    model.train(was)
    return out


def warm_up(shape, sizes, *, steps, lr=1e-3, batch_size=64, seed=0, lengths=None, eval_lengths=(),
            eval_every=0, eval_prompts=EVAL_PROMPTS, task=recall, init=None, log=print):
    """A model built from `shape` (random weights from `seed`; or `init`, a model to train further, shape unused)
    trained `steps` AdamW steps on `task`'s prompts of `sizes` (prompt_tokens drawn per step from `lengths` when
    given); returns (model, history) where history holds {"step", "loss", "accuracy": {length: acc}} every
    `eval_every` steps (and at the end)."""
    from ds_longstraw.models.modeling import build_model

    model = init if init is not None else build_model(shape=shape, seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    lengths = list(lengths or [sizes["prompt_tokens"]])
    sets = held_out(sizes, eval_lengths, eval_prompts, task)
    history, start, running = [], time.perf_counter(), None
    gen = torch.Generator().manual_seed(seed)
    warm = max(1, steps // 20)
    for step in range(steps):
        for group in optimizer.param_groups:  # linear warm-up, cosine decay to a tenth
            progress = step / max(1, steps - 1)
            group["lr"] = lr * min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        n = lengths[int(torch.randint(0, len(lengths), (), generator=gen))]
        prompts, answers = task.batch(seed, step * batch_size, batch_size, **{**sizes, "prompt_tokens": n})
        logits = model(input_ids=prompts).logits[:, -1]
        loss = torch.nn.functional.cross_entropy(logits, answers)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        running = float(loss.detach()) if running is None else 0.95 * running + 0.05 * float(loss.detach())
        last = step + 1 == steps
        if (eval_every and (step + 1) % eval_every == 0) or last:
            acc = evaluate(model, sets)
            history.append({"step": step + 1, "loss": round(running, 4), "accuracy": acc,
                            "seconds": round(time.perf_counter() - start, 1)})
            log(f"[warm-up] step {step + 1}/{steps} loss {running:.3f} "
                + " ".join(f"acc@{n} {a:.3f}" for n, a in acc.items()) + f"  {time.perf_counter() - start:.0f} s")
    model.eval()
    return model, history


def cached(directory, shape, sizes, **kwargs):
    """The warm-up checkpoint in `directory` (a transformers save_pretrained directory), built by `warm_up` on
    first use with these arguments; a directory built with other arguments is rebuilt. Returns its path."""
    directory = Path(directory)
    shape_text = Path(shape).read_text() if not isinstance(shape, dict) else json.dumps(shape, sort_keys=True)
    recipe = {"shape": hashlib.sha256(shape_text.encode()).hexdigest()[:16], "sizes": sizes,
              **{k: (list(v) if isinstance(v, tuple) else v) for k, v in kwargs.items() if k not in ("log", "task")}}
    if kwargs.get("task", recall) is not recall:  # recall's recipes predate the argument: theirs stay as they were
        recipe["task"] = kwargs["task"].__name__
    stamp = directory / "recipe.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("recipe") == recipe:
        return directory
    model, history = warm_up(shape, sizes, **kwargs)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    stamp.write_text(json.dumps({"recipe": recipe, "history": history}, indent=1))
    return directory


if __name__ == "__main__":  # a probe: python -m ds_longstraw.tasks.recall_warmup SHAPE STEPS LR LENGTHS EVALS
    import sys

    torch.set_num_threads(1)
    shape, steps, lr = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    lengths = [int(x) for x in sys.argv[4].split(",")]
    evals = [int(x) for x in sys.argv[5].split(",")]
    extra = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
    batch_size = int(extra.pop("batch", 64))
    save = extra.pop("save", None)
    eval_prompts = int(extra.pop("eval_prompts", EVAL_PROMPTS))
    sizes = {"prompt_tokens": lengths[0], "records": 4, "keys": 8, "values": 8, "fillers": 8, **extra}
    model, _ = warm_up(shape, sizes, steps=steps, lr=lr, lengths=lengths, eval_lengths=evals,
                       eval_every=max(1, steps // 6), batch_size=batch_size, eval_prompts=eval_prompts)
    if save:
        model.save_pretrained(save)
