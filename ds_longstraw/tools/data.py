"""GRPO groups from JSONL, one group per line, and which groups each data-parallel rank takes at each step.

A line is a JSON object with either token ids or text:

    {"prompt_ids": [..], "response_ids": [[..], [..]], "rewards": [1.0, 0.0]}
    {"prompt": "text", "responses": ["text", "text"], "advantages": [0.5, -0.5]}

`rewards` or `advantages` (one per response); optional `old_logprobs` and `sampling_logprobs` (the rollout engine's,
for GRPOObjective's rollout_correction), per response, one per token. Text goes
through the model's tokenizer without special tokens (a chat template, if wanted, belongs in the text).

Agent trajectories, whose responses hold tokens the environment wrote (tool outputs: context, not trained; see
GRPOGroup.response_masks), say which tokens train in either form:

    {"prompt_ids": [..], "response_ids": [[5, 6, 7, 8]], "response_masks": [[1, 0, 0, 1]], "rewards": [1.0]}
    {"prompt": "text", "responses": [[{"text": "call", "train": true}, {"text": "tool output", "train": false},
                                      {"text": "answer", "train": true}], "plain text"], "rewards": [1.0, 0.0]}

`response_masks` (with `response_ids` only): one list per response, as long as it, of 0/1 or true/false. A text
response may be a list of segments {"text", "train"}: each segment is tokenized on its own and the ids are
concatenated (so a boundary never merges a tool's text with the policy's, as it would not in the sampler's ids);
its mask is `train` over the segment's tokens. A plain-string response in the same group trains every token.

Order: step s, rank r of W, k groups per rank take group indices s*W*k + r*k + j (j < k) of the epoch's order,
wrapping around at the end of the file; with a shuffle seed each epoch has its own permutation. Nothing but the
step number is needed to resume.
"""

import json

import torch

from ds_longstraw.group import GRPOGroup


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


def _id_tensor(ids):
    """Token ids as JSON gives them; an empty list (a text response that tokenizes to nothing) becomes an empty
    integer tensor, so the group reports the response as empty rather than as floating point."""
    ids = torch.as_tensor(ids)
    return ids.long() if ids.numel() == 0 else ids


def _masks_from_json(masks):
    """response_masks as JSON gives them (lists of 0/1 or true/false) -> lists of booleans; lengths and counts are
    GRPOGroup's to check."""
    if not isinstance(masks, list):
        raise ValueError(f"response_masks must be a list (one mask per response), got {type(masks).__name__}")
    out = []
    for i, mask in enumerate(masks):
        if not isinstance(mask, list):
            raise ValueError(f"response_masks[{i}] must be a list of 0/1 or true/false, got {type(mask).__name__}")
        bad = [v for v in mask if not (isinstance(v, bool) or (isinstance(v, int) and v in (0, 1)))]
        if bad:
            raise ValueError(f"response_masks[{i}] must hold only 0/1 or true/false, got {bad[0]!r}")
        out.append([bool(v) for v in mask])
    return out


def _segment(path, number, response, index, segment):
    """(text, train) of one segment of a text response."""
    where = f"responses[{response}] segment {index}"
    if not isinstance(segment, dict) or set(segment) != {"text", "train"}:
        raise _record_error(path, number, f"{where} must be {{\"text\": ..., \"train\": true/false}}, "
                                          f"got {json.dumps(segment)[:80]}")
    if not isinstance(segment["text"], str):
        raise _record_error(path, number, f"{where}: 'text' must be a string")
    if not isinstance(segment["train"], bool):
        raise _record_error(path, number, f"{where}: 'train' must be true or false, got {segment['train']!r}")
    return segment["text"], segment["train"]


class GroupSource:
    """The groups of one JSONL file, turned into GRPOGroups on demand (text tokenized with `tokenizer`)."""

    def __init__(self, path, tokenizer=None, shuffle_seed=None):
        self.path = str(path)
        self.records = read_jsonl(path)
        self.tokenizer = tokenizer
        self.shuffle_seed = shuffle_seed

    def __len__(self):
        return len(self.records)

    def _encode(self, number, text_key, text):
        if self.tokenizer is None:
            raise _record_error(self.path, number, f"'{text_key}' is text but no tokenizer is configured "
                                                   "(data.tokenizer, or model.pretrained with a tokenizer)")
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _ids(self, number, record, ids_key, text_key):
        if ids_key in record:
            return record[ids_key]
        if text_key not in record:
            raise _record_error(self.path, number, f"needs '{ids_key}' (token ids) or '{text_key}' (text)")
        texts = record[text_key]
        return self._encode(number, text_key, texts) if isinstance(texts, str) else \
            [self._encode(number, text_key, t) for t in texts]

    def _responses(self, number, record):
        """(response ids, response masks or None) of a record, from token ids or from text."""
        if "response_ids" in record or "responses" not in record:
            ids = self._ids(number, record, "response_ids", "responses")
            masks = record.get("response_masks")
            return ids, None if masks is None else _masks_from_json(masks)
        if "response_masks" in record:
            raise _record_error(self.path, number, "'response_masks' goes with 'response_ids'; a text response "
                                                   "says what trains with segments {\"text\", \"train\"}")
        responses = record["responses"]
        if isinstance(responses, str) or not isinstance(responses, list):
            raise _record_error(self.path, number, "'responses' must be a list (one entry per response)")
        ids, masks, segmented = [], [], False
        for i, response in enumerate(responses):
            if isinstance(response, str):
                tokens = self._encode(number, "responses", response)
                ids.append(tokens)
                masks.append([True] * len(tokens))
                continue
            if not isinstance(response, list):
                raise _record_error(self.path, number, f"responses[{i}] must be text or a list of segments "
                                                       f"{{\"text\", \"train\"}}, got {type(response).__name__}")
            segmented = True
            tokens, mask = [], []
            for j, segment in enumerate(response):
                text, train = _segment(self.path, number, i, j, segment)
                piece = self._encode(number, "responses", text)
                tokens += piece
                mask += [train] * len(piece)
            ids.append(tokens)
            masks.append(mask)
        return ids, masks if segmented else None

    def group(self, index) -> GRPOGroup:
        number, record = self.records[index]
        unknown = set(record) - {"prompt_ids", "prompt", "response_ids", "responses", "response_masks", "rewards",
                                 "advantages", "old_logprobs", "sampling_logprobs", "id", "meta"}
        if unknown:
            raise _record_error(self.path, number, f"unknown keys {sorted(unknown)}")
        try:
            responses, masks = self._responses(number, record)
            return GRPOGroup(prompt_ids=torch.as_tensor(self._ids(number, record, "prompt_ids", "prompt")),
                             response_ids=[_id_tensor(r) for r in responses],
                             rewards=record.get("rewards"), advantages=record.get("advantages"),
                             old_logprobs=record.get("old_logprobs"),
                             sampling_logprobs=record.get("sampling_logprobs"),
                             response_masks=None if masks is None else
                             [torch.tensor(m, dtype=torch.bool) for m in masks])
        except ValueError as error:
            if str(error).startswith(f"{self.path}:"):  # already names the line
                raise
            raise _record_error(self.path, number, str(error)) from None

    def prompt(self, index) -> torch.Tensor:
        """Record `index`'s prompt alone (token ids, or its text tokenized), for rollouts that sample the responses;
        other keys of the record are not read."""
        number, record = self.records[index]
        try:
            from ds_longstraw.group import as_ids

            return as_ids("prompt_ids", self._ids(number, record, "prompt_ids", "prompt"))
        except ValueError as error:
            if str(error).startswith(f"{self.path}:"):
                raise
            raise _record_error(self.path, number, str(error)) from None

    def prompts_for_step(self, step, rank, world, per_rank=1) -> list:
        """The prompts rank `rank` of `world` samples from at optimizer step `step` (for_step's order)."""
        return [self.prompt(i) for i in self.indices_for_step(step, rank, world, per_rank)]

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
