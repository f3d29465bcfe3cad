"""One-rank ZeRO-3 checkpoints for the export unit tests: `python one_rank_checkpoints.py OUT [PORT]`.

For each run (a full fine-tune with a tokenizer; LoRA over random shape weights, no base directory; the same full
fine-tune of the tiny glm_moe_dsa, whose MoE experts transformers saves per expert), one AdamW step on a
language-model loss under a DeepSpeed ZeRO-3 engine, then what launch/train.py leaves: the checkpoint (tag step1)
with its run record, and the trained module's full parameters (OUT/<run>.pt, gathered) as the reference.
"""

import json
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHAPES = {"full": "tiny_qwen3_5.yaml", "lora": "tiny_qwen3_5.yaml", "glm": "tiny_glm_moe_dsa.yaml"}


def tiny_tokenizer(vocab_size):
    """A word-level tokenizer over the model's vocabulary (no download): 't0' ... 't<n-1>'."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="t0", eos_token=f"t{vocab_size - 1}")


def main(out, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    import deepspeed

    import ds_longstraw
    from ds_longstraw.engine.checkpoint_files import save_record
    from ds_longstraw.engine.run_config import load_run_config
    from ds_longstraw.models.lora import apply_lora
    from ds_longstraw.models.modeling import build_model

    with open(os.path.join(REPO, "configs", "deepspeed", "zero3_cpu.json")) as handle:
        ds = json.load(handle)
    ds.update(gradient_clipping=0.0, longstraw={"enabled": False})
    for name, shape in SHAPES.items():
        shape = os.path.join(REPO, "configs", "models", shape)
        lora = name == "lora"
        run = load_run_config(None, [f"deepspeed_config={out}/ds.json", f"data.path={out}/groups.jsonl",
                                     f"model.shape={shape}", f"lora.enabled={str(lora).lower()}", "lora.r=4",
                                     f"train.save_dir={out}/{name}"])
        model = build_model(shape=shape, dtype="float32", seed=0)
        if lora:
            model = apply_lora(model, r=4, alpha=32, seed=0)
        params = [p for p in model.parameters() if p.requires_grad]
        engine, *_ = ds_longstraw.initialize(model=model, optimizer=torch.optim.AdamW(params, lr=1e-2),
                                             config=dict(ds))
        torch.manual_seed(1)
        ids = torch.randint(0, model.config.vocab_size, (1, 48))
        engine.backward(engine(input_ids=ids, labels=ids, use_cache=False).loss)
        engine.step()
        engine.save_checkpoint(os.path.join(out, name), tag="step1")
        tokenizer = tiny_tokenizer(model.config.vocab_size) if name == "full" else None
        save_record(os.path.join(out, name, "step1"), run, engine.module, tokenizer)
        dump = {}
        for pname, param in engine.module.named_parameters():
            with deepspeed.zero.GatheredParameters([param]):
                dump[pname] = param.detach().clone()
        torch.save(dump, os.path.join(out, f"{name}.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 29613)
