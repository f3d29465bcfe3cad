"""GRPO groups from JSONL, one group per line, and which groups each data-parallel rank takes at each step.

A line is a JSON object with either token ids or text:

    {"prompt_ids": [..], "response_ids": [[..], [..]], "rewards": [1.0, 0.0]}
    {"prompt": "text", "responses": ["text", "text"], "advantages": [0.5, -0.5]}

`rewards` or `advantages` (one per response); optional `old_logprobs` (per response, one per token). Text goes
through the model's tokenizer without special tokens (a chat template, if wanted, belongs in the text).

Order: step s, rank r of W, k groups per rank take group indices s*W*k + r*k + j (j < k) of the epoch's order,
wrapping around at the end of the file; with a shuffle seed each epoch has its own permutation. Nothing but the
step number is needed to resume.
"""

import json

import torch

from .group import GRPOGroup


def _record_error(path, line, message):
    return ValueError(f"{path}:{line}: {message}")


def read_jsonl(path) -> list:
    records = []
    with open(path) as handle:
        for number, text in enumerate(handle, 1):
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as error:
                raise _record_error(path, number, f"not JSON: {error}") from None
            if not isinstance(record, dict):
                raise _record_error(path, number, "each line must be a JSON object (one group)")
            records.append((number, record))
    if not records:
        raise ValueError(f"{path}: no groups")
    return records


class GroupSource:
    """The groups of one JSONL file, turned into GRPOGroups on demand (text tokenized with `tokenizer`)."""

    def __init__(self, path, tokenizer=None, shuffle_seed=None):
        self.path = str(path)
        self.records = read_jsonl(path)
        self.tokenizer = tokenizer
        self.shuffle_seed = shuffle_seed

    def __len__(self):
        return len(self.records)

    def _ids(self, number, record, ids_key, text_key):
        if ids_key in record:
            return record[ids_key]
        if text_key not in record:
            raise _record_error(self.path, number, f"needs '{ids_key}' (token ids) or '{text_key}' (text)")
        if self.tokenizer is None:
            raise _record_error(self.path, number, f"'{text_key}' is text but no tokenizer is configured "
                                                   "(data.tokenizer, or model.pretrained with a tokenizer)")
        texts = record[text_key]
        encode = lambda text: self.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        return encode(texts) if isinstance(texts, str) else [encode(t) for t in texts]

    def group(self, index) -> GRPOGroup:
        number, record = self.records[index]
        unknown = set(record) - {"prompt_ids", "prompt", "response_ids", "responses", "rewards", "advantages",
                                 "old_logprobs", "id", "meta"}
        if unknown:
            raise _record_error(self.path, number, f"unknown keys {sorted(unknown)}")
        try:
            return GRPOGroup(prompt_ids=torch.as_tensor(self._ids(number, record, "prompt_ids", "prompt")),
                             response_ids=[torch.as_tensor(r) for r in
                                           self._ids(number, record, "response_ids", "responses")],
                             rewards=record.get("rewards"), advantages=record.get("advantages"),
                             old_logprobs=record.get("old_logprobs"))
        except ValueError as error:
            raise _record_error(self.path, number, str(error)) from None

    def order(self, epoch):
        if self.shuffle_seed is None:
            return list(range(len(self)))
        gen = torch.Generator().manual_seed(int(self.shuffle_seed) * 1_000_003 + epoch)
        return torch.randperm(len(self), generator=gen).tolist()

    def indices_for_step(self, step, rank, world, per_rank=1) -> list:
        out = []
        for j in range(per_rank):
            flat = (step * world + rank) * per_rank + j
            epoch, position = divmod(flat, len(self))
            out.append(self.order(epoch)[position])
        return out

    def for_step(self, step, rank, world, per_rank=1) -> list:
        """The GRPOGroups rank `rank` of `world` trains on at optimizer step `step` (0-based)."""
        return [self.group(i) for i in self.indices_for_step(step, rank, world, per_rank)]
