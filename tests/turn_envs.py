"""Environments for the multi-turn rollout tests (rollout/environment.py), and transformers' turn-by-turn reference.

ToolTable answers a sample's tool call with an observation whose length comes from a table (by sample and turn, so
samples wait on observations of different lengths, one of them empty) and whose tokens are a function of the
response so far (so a decoder that hands it the wrong tokens gets different observations). It is deterministic:
the reference and the code under test each ask their own instance and get the same answers.
"""

import torch


class ToolTable:
    def __init__(self, stop_ids, lengths=(3, 0, 6, 1, 9, 2), end_at=None, vocab=97):
        self.stop_ids = tuple(stop_ids)
        self.lengths, self.end_at, self.vocab = tuple(lengths), dict(end_at or {}), vocab
        self.calls = []  # (sample, response so far) per call, in order

    def observe(self, sample, response_ids):
        turn = sum(1 for s, _ in self.calls if s == sample)
        self.calls.append((sample, response_ids.tolist()))
        if self.end_at.get(sample) == turn:
            return None
        count = self.lengths[(sample + 2 * turn) % len(self.lengths)]
        base = int(response_ids.sum()) + 31 * sample
        return [(base + 7 * i) % self.vocab for i in range(count)]


def transformers_turns(model, prompt, environment, sample, max_new, eos=(), max_turns=None, use_generate=True):
    """(response ids, response mask) of greedy decoding with transformers' generate run turn by turn: generate until
    a stop id or eos, append the environment's observation, generate again on the whole context (no cache kept
    between turns). use_generate=False: every token the argmax of transformers' forward of the whole sequence."""
    stops = tuple(environment.stop_ids)
    model.generation_config.eos_token_id = None  # the config's default eos (GLM's 1) would stop it early
    response, mask, turns = [], [], 0
    while len(response) < max_new:
        context = torch.cat([prompt, torch.tensor(response, dtype=torch.long)])
        generated = _generate if use_generate else _full_forward_greedy
        new = generated(model, context, max_new - len(response), stops + tuple(eos))
        response += new
        mask += [True] * len(new)
        if new[-1] not in stops or len(response) >= max_new or (max_turns is not None and turns >= max_turns):
            break
        observation = environment.observe(sample, torch.tensor(response, dtype=torch.long))
        turns += 1
        if observation is None:
            break
        observation = observation[: max_new - len(response)]
        response += observation
        mask += [False] * len(observation)
    return torch.tensor(response, dtype=torch.long), torch.tensor(mask, dtype=torch.bool)


def _generate(model, context, max_new, stops):
    out = model.generate(context.unsqueeze(0), max_new_tokens=max_new, do_sample=False, eos_token_id=list(stops),
                         pad_token_id=0)
    return out[0, context.numel():].tolist()


def _full_forward_greedy(model, context, max_new, stops):
    new = []
    with torch.no_grad():
        while len(new) < max_new and not (new and new[-1] in stops):
            ids = torch.cat([context, torch.tensor(new, dtype=torch.long)]).unsqueeze(0)
            new.append(int(model(ids, use_cache=False).logits[0, -1].argmax()))
    return new


def tool_table(prompt_ids):
    """A rollout block's environment factory (`environment: turn_envs:tool_table`): a ToolTable per prompt."""
    return ToolTable(range(2, 97, 5), lengths=(3, 0, 6, 1, 9, 2, int(prompt_ids[0]) % 5))
