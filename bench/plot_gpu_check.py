"""The GPU check's kernel candidates as a picture: attention (flash, cuDNN, SDPA) and log-probs (the chunked torch
steps, the Triton steps, the fused Triton kernels, full logits), time against keys, from a gpu_check.json.

    python bench/plot_gpu_check.py bench/results/gpu_check_h200_2026-12-04.json bench/gpu_candidates.png
"""

import json
import sys

ATTENTION = {"fast": "flash (varlen, the old default)", "fast_cudnn": "cuDNN (the default now)",
             "peer": "SDPA (no lse: a peer)",
             "backward_constant_keys_triton_dq": "Triton dq, backward only (constant keys)"}
LOGPROBS = {"chunked": "chunked, torch steps", "chunked_triton_steps": "chunked, Triton steps (dispatched)",
            "triton": "fused Triton", "full_logits": "full logits (peer)"}


def main(source, target):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(source) as handle:
        sections = json.load(handle)["sections"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.4))
    rows = sections["attention"]["rows"]
    for path, label in ATTENTION.items():
        points = sorted((row["tk"], row["ms"]) for row in rows if row["path"] == path)
        left.plot([k for k, _ in points], [ms for _, ms in points], "o-", label=label)
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("keys (one 1,024-query block, 24 / 4 heads of 256)")
    left.set_ylabel("forward + backward (ms)")
    left.set_title("attention")
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=8)
    rows = sections["logprobs"]["rows"]
    heads = ("trained", "frozen")
    width = 0.2
    for offset, (path, label) in enumerate(LOGPROBS.items()):
        values = [next(row["ms"] for row in rows if row["path"] == path and row["head"] == head) for head in heads]
        right.bar([i + (offset - 1.5) * width for i in range(len(heads))], values, width, label=label)
    right.set_xticks(range(len(heads)), [f"{head} head" for head in heads])
    right.set_ylabel("forward + backward (ms)")
    right.set_title("log-probs, 1,024 tokens over 248,320 ids")
    right.legend(fontsize=8)
    figure.suptitle("Kernel candidates on one H200 (bf16, medians of 5)")
    figure.tight_layout()
    figure.savefig(target, dpi=120)
    print(f"plot: {target}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
