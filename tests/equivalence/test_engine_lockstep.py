"""Lockstep (ds_longstraw/grpo/lockstep.py), single process: what makes ZeRO-3 data parallelism with different groups
per rank possible, checked without a launcher.

  module calls:  two groups of different shapes, each padded to their common shape, make the SAME sequence of
                 parameter-owning module calls, forward and backward (what ZeRO-3 turns into weight gathers),
                 and the same number of backward calls, in both gradient modes, with and without a KL reference;
                 a dummy group padded to the same shape does too.
  results:       padding leaves the loss, log-probs and gradients unchanged (float64 end to end under
                 float64_model(); the dummy blocks change blocked matmul shapes, so agreement is to rounding:
                 relative 1e-12, measured 2e-16 .. 3e-16. Without float64_model() transformers' norms round
                 in float32 and the same comparison gives 1e-10).
"""

import copy

import pytest
import torch
from grads import grads_of, relative_l2
from models import float64_model, tiny_qwen3_5

from ds_longstraw import GRPOGroup, GRPOObjective, grpo_backward, parse_config
from ds_longstraw.grpo.lockstep import GroupCalls, Lockstep, calls_of, dummy_group, most_calls

BLOCK = {"capture_chunk": 8, "replay_block": 3, "page_tokens": 4}

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")


def _group(seed, prompt_len, response_lens):
    gen = torch.Generator().manual_seed(seed)
    return GRPOGroup(torch.randint(0, 97, (prompt_len,), generator=gen),
                     [torch.randint(0, 97, (n,), generator=gen) for n in response_lens],
                     rewards=torch.rand(len(response_lens), generator=gen).tolist())


def _trace(model, group, lockstep, longstraw, objective, ref_model):
    """Sequence of ("F"|"B", module) for modules owning parameters, and "backward" for each back-propagation."""
    events, hooks = [], []
    for name, module in model.named_modules():
        if name and list(module.parameters(recurse=False)):
            hooks.append(module.register_forward_pre_hook(lambda m, a, n=name: events.append(("F", n))))
            hooks.append(module.register_full_backward_pre_hook(lambda m, g, n=name: events.append(("B", n))))
    if ref_model is not None:
        for name, module in ref_model.named_modules():
            if name and list(module.parameters(recurse=False)):
                hooks.append(module.register_forward_pre_hook(lambda m, a, n=name: events.append(("ref", n))))

    def backward(loss):
        events.append("backward")
        loss.backward()

    try:
        grpo_backward(model, group, objective, longstraw=longstraw, ref_model=ref_model, backward=backward,
                      lockstep=lockstep)
    finally:
        for hook in hooks:
            hook.remove()
    return events


@pytest.mark.parametrize("mode", ["detached", "exact"])
@pytest.mark.parametrize("kl", [0.0, 0.1], ids=["no-kl", "kl"])
def test_padded_groups_make_the_same_module_calls(mode, kl):
    longstraw = parse_config({**BLOCK, "prefix_grad": mode})
    model = tiny_qwen3_5(torch.float32, seed=0)
    ref_model = copy.deepcopy(model) if kl > 0 else None
    objective = GRPOObjective(kl_coef=kl)
    a, b = _group(1, 20, [4, 1, 7]), _group(2, 11, [5, 3])  # 3 vs 2 chunks; blocks [2, 1, 3] vs [2, 1]
    dummy = dummy_group()
    common = most_calls([calls_of(a, longstraw), calls_of(b, longstraw)])
    assert common == GroupCalls(chunks=3, blocks=(2, 1, 3))
    traces = [_trace(model, g, Lockstep(calls_of(g, longstraw), common, longstraw), longstraw, objective, ref_model)
              for g in (a, b, dummy)]
    assert traces[0] == traces[1] == traces[2]
    assert traces[0].count("backward") == 3 + (3 if mode == "exact" else 0)
    # and without padding they differ (the check has teeth)
    assert _trace(model, b, None, longstraw, objective, ref_model) != traces[1]


@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_padding_leaves_results_unchanged(mode):
    longstraw = parse_config({**BLOCK, "prefix_grad": mode})
    model = tiny_qwen3_5(torch.float64, seed=3)
    group = _group(4, 13, [2, 5])
    objective = GRPOObjective(kl_coef=0.05)
    ref_model = tiny_qwen3_5(torch.float64, seed=4)
    common = GroupCalls(chunks=4, blocks=(3, 2, 2, 1))
    with float64_model():
        plain_grads, plain = grads_of(model, lambda: grpo_backward(model, group, objective, longstraw=longstraw,
                                                                   ref_model=ref_model))
        padded_grads, padded = grads_of(model, lambda: grpo_backward(
            model, group, objective, longstraw=longstraw, ref_model=ref_model,
            lockstep=Lockstep(calls_of(group, longstraw), common, longstraw)))
    assert relative_l2(padded_grads, plain_grads) < 1e-12
    assert padded.loss == pytest.approx(plain.loss, rel=1e-12)
    for x, y in zip(padded.logprobs + padded.ref_logprobs, plain.logprobs + plain.ref_logprobs, strict=True):
        assert x.shape == y.shape and torch.allclose(x, y, rtol=0, atol=1e-12)


def test_shapes_and_bad_lockstep():
    longstraw = parse_config(BLOCK)
    assert calls_of(_group(0, 9, [3, 4]), longstraw) == GroupCalls(1, (1, 2))
    assert calls_of(_group(0, 10, [3, 4]), longstraw) == GroupCalls(2, (1, 2))
    assert most_calls([GroupCalls(1, (2,)), GroupCalls(3, (1, 1, 4))]) == GroupCalls(3, (2, 1, 4))
    with pytest.raises(ValueError, match="exceeds"):
        Lockstep(GroupCalls(2, (1,)), GroupCalls(1, (1,)), longstraw)


def _tool_group(seed, prompt_len, members, held=None):
    """members: [(length, [(lo, hi) untrained spans])]; held: the members' held prefixes (GRPOGroup.held_prefixes)."""
    from masked_loss import masks_from_spans

    gen = torch.Generator().manual_seed(seed)
    return GRPOGroup(torch.randint(0, 97, (prompt_len,), generator=gen),
                     [torch.randint(0, 97, (n,), generator=gen) for n, _ in members],
                     rewards=torch.rand(len(members), generator=gen).tolist(),
                     response_masks=masks_from_spans(members), held_prefixes=held)


@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_members_in_steps_keep_the_ranks_in_lockstep(mode):
    """A member with a long tool span runs in steps (member_steps.py); where one rank's member of a slot does, every
    rank runs that slot in steps of one block, so the module calls still match: group a's first member is in
    steps, b's members are not, the dummy group has none; the three make the same calls, and each one's results
    are its plain transaction's (float64: relative 1e-10, the steps differentiate the same function in pieces)."""
    longstraw = parse_config({**BLOCK, "prefix_grad": mode, "member_span_capture": 3})
    model = tiny_qwen3_5(torch.float32, seed=0)
    objective = GRPOObjective()
    a = _tool_group(1, 14, [(9, [(1, 6)]), (4, [])])
    b = _tool_group(2, 10, [(5, []), (7, [(2, 4)]), (2, [])])
    calls_a, calls_b = calls_of(a, longstraw), calls_of(b, longstraw)
    assert calls_a.stepped == (1, 0) and calls_b.stepped == ()  # b: a 2-token span, below the threshold of 3
    common = most_calls([calls_a, calls_b])
    assert common.stepped == (1, 0, 0) and common.blocks == (3, 3, 1)
    assert _trace(model, b, None, longstraw, objective, None) != _same_calls(model, (a, b), common, longstraw,
                                                                             objective)
    for padded, plain in _padded_and_plain((a, b), common, longstraw, objective):
        assert padded.extras["members_in_steps"] == 1  # slot 0 runs in steps on every rank
        for x, y in zip(padded.logprobs, plain.logprobs, strict=True):
            trained = y != 0  # a captured span's log-probs are not computed on the plain path (0)
            assert x.shape == y.shape and torch.allclose(x[trained], y[trained], rtol=0, atol=1e-10)


def _same_calls(model, groups, common, longstraw, objective):
    """The module calls of each group and of a dummy group, padded to `common`: asserted equal, returned once."""
    traces = [_trace(model, g, Lockstep(calls_of(g, longstraw), common, longstraw), longstraw, objective, None)
              for g in (*groups, dummy_group())]
    assert all(trace == traces[0] for trace in traces)
    return traces[0]


def _padded_and_plain(groups, common, longstraw, objective):
    """Per group, (result padded to `common`, plain result) in float64, their gradients and losses asserted equal
    (relative 1e-10: the same function, its padded steps cut differently)."""
    double = tiny_qwen3_5(torch.float64, seed=3)
    out = []
    with float64_model():
        for group in groups:
            plain_grads, plain = grads_of(double, lambda g=group: grpo_backward(double, g, objective,
                                                                                longstraw=longstraw))
            padded_grads, padded = grads_of(double, lambda g=group: grpo_backward(
                double, g, objective, longstraw=longstraw,
                lockstep=Lockstep(calls_of(g, longstraw), common, longstraw)))
            assert relative_l2(padded_grads, plain_grads) < 1e-10
            assert padded.loss == pytest.approx(plain.loss, rel=1e-10)
            out.append((padded, plain))
    return out


@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_held_prefixes_keep_the_ranks_in_lockstep(mode):
    """Members that hold their first tokens (GRPOGroup.held_prefixes: a shared document's question under the
    flat form in detached mode, grpo/flat_document.py) run in steps; every rank cuts its steps of a slot where any
    rank's held prefix of that slot ends, and a rank's held steps run a backward of zero gradient where another
    rank's may be trained. Groups a and b hold different lengths in the same slots, the dummy group none: the three
    make the same module calls, and each one's results are its plain transaction's (float64, relative 1e-10)."""
    longstraw = parse_config({**BLOCK, "prefix_grad": mode})
    model = tiny_qwen3_5(torch.float32, seed=0)
    objective = GRPOObjective()
    a = _tool_group(1, 14, [(8, [(0, 7)]), (4, [(0, 1)])], held=[7, 1])
    # slot 0: a's held prefix ends (7) past b's member, even padded to the slot's 3 blocks (7 tokens): b pads it
    # past that end, so both make the same steps
    b = _tool_group(2, 10, [(3, [(0, 2)]), (7, [(0, 5)]), (2, [])], held=[2, 5, 0])
    calls_a, calls_b = calls_of(a, longstraw), calls_of(b, longstraw)
    assert calls_a.stepped == (1, 1) and calls_b.stepped == (1, 1, 0)
    common = most_calls([calls_a, calls_b])
    assert common.held == ((2, 7), (1, 5), ()) and common.stepped == (1, 1, 0)
    assert GroupCalls.decode(common.encode()) == common
    alone = Lockstep(calls_b, most_calls([calls_b]), longstraw)
    assert _trace(model, b, alone, longstraw, objective, None) != _same_calls(model, (a, b), common, longstraw,
                                                                              objective)
    _padded_and_plain((a, b), common, longstraw, objective)


def test_a_held_prefix_is_a_constant():
    """What holding means: a member holding its first h tokens gets the gradient of a group whose prompt ends with
    them, in detached mode (their state a constant there too); replayed without the hold, it differs."""
    longstraw = parse_config({**BLOCK, "prefix_grad": "detached"})
    model = tiny_qwen3_5(torch.float64, seed=3)
    gen = torch.Generator().manual_seed(5)
    prompt, response = torch.randint(0, 97, (11,), generator=gen), torch.randint(0, 97, (9,), generator=gen)
    mask = torch.ones(9, dtype=torch.bool)
    mask[:4] = False
    held = GRPOGroup(prompt, [response], advantages=[0.8], response_masks=[mask], held_prefixes=[4])
    not_held = GRPOGroup(prompt, [response], advantages=[0.8], response_masks=[mask])
    longer_prompt = GRPOGroup(torch.cat([prompt, response[:4]]), [response[4:]], advantages=[0.8])
    with float64_model():
        grads, result = grads_of(model, lambda: grpo_backward(model, held, GRPOObjective(), longstraw=longstraw))
        reference, expected = grads_of(model, lambda: grpo_backward(model, longer_prompt, GRPOObjective(),
                                                                    longstraw=longstraw))
        other, _ = grads_of(model, lambda: grpo_backward(model, not_held, GRPOObjective(), longstraw=longstraw))
    assert relative_l2(grads, reference) < 1e-10
    assert result.loss == pytest.approx(expected.loss, rel=1e-10)
    assert relative_l2(other, reference) > 1e-4
    with pytest.raises(ValueError, match=r"held_prefixes\[0\] = 5 covers tokens"):
        GRPOGroup(prompt, [response], advantages=[0.8], response_masks=[mask], held_prefixes=[5])
    with pytest.raises(ValueError, match=r"held_prefixes\[0\] must be a token count"):
        GRPOGroup(prompt, [response], advantages=[0.8], response_masks=[mask], held_prefixes=[10])
