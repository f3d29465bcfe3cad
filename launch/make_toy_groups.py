"""Write a JSONL of random GRPO groups (token ids) for smoke runs: python launch/make_toy_groups.py OUT [options]."""

import argparse
import json
import os

import torch


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=61)
    parser.add_argument("--group-size", type=int, default=3)
    parser.add_argument("--response-tokens", type=int, default=9)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    gen = torch.Generator().manual_seed(args.seed)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as out:
        for _ in range(args.groups):
            # prompt and response lengths vary per group (not multiples of any chunk or page size)
            prompt_len = int(torch.randint(max(2, args.prompt_tokens // 2), args.prompt_tokens + 1, (1,),
                                           generator=gen))
            lengths = torch.randint(1, args.response_tokens + 1, (args.group_size,), generator=gen).tolist()
            record = {
                "prompt_ids": torch.randint(0, args.vocab, (prompt_len,), generator=gen).tolist(),
                "response_ids": [torch.randint(0, args.vocab, (n,), generator=gen).tolist() for n in lengths],
                "rewards": [round(float(r), 4) for r in torch.rand(args.group_size, generator=gen)],
            }
            out.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
