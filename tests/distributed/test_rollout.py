"""ds_longstraw.generate: rollouts decoded from the captured prompt state, against transformers and float64 references.

Equivalence chains (float64 tiny models; qwen3_5 under float64_model(), glm_moe_dsa under glm_reference()):
  generate(temperature=0) == transformers' model.generate(do_sample=False), token for token (eos included)
  generate(...).logprobs == full-sequence log-softmax of prompt + response at the sampling temperature (logits /
      temperature; greedy: 1) (tests/models.py full_sequence_logprobs)
  generate(seed=s) == generate(seed=s); generate(seed=s) != generate(seed=s + 1)
  generate(host tier) == generate(device tier); generate(CP 2), every rank == generate(one rank)
  grpo_backward(rollouts.group(rewards)).logprobs == rollouts.logprobs (the transaction's replay of the samples, at
      the objective's temperature = the sampling temperature)
Tolerance: relative 1e-8 on log-probs (the issue's contract). Both sides are float64 and differ only in the order of
their sums (one token per forward against one forward of the whole sequence; CP merges partials by LSE): measured
~2e-16 here. Token ids are compared exactly: a sample drawn by inverse CDF changes only when a uniform lands within
rounding of a boundary. The response rows' buffers are poisoned (NaN) in every test: a row read before it is written
shows up as NaN log-probs.
"""

import pytest
import torch
from cp_scripts.rollout_ranks import case_model, case_prompt, case_rollouts, run_rollouts
from models import float64_model, full_sequence_logprobs, tiny_qwen3_5
from rollout_families import FAMILIES, family_prompt, poison_rows

import ds_longstraw.rollout.generate as rollout
from ds_longstraw import GRPOObjective, Rollouts, generate, grpo_backward
from ds_longstraw.config import parse_config
from ds_longstraw.grpo.lockstep import GroupCalls, Lockstep, calls_of

TOL = 1e-8


@pytest.fixture(autouse=True)
def poisoned_rows(monkeypatch):
    poison_rows(monkeypatch)


@pytest.fixture(scope="module")
def models():
    return {name: family["build"]() for name, family in FAMILIES.items()}


_prompt = family_prompt


def _relative(a, b):
    return float(((a - b).abs() / b.abs()).max())


def _assert_logprobs(model, family, prompt, result, temperature=1.0):
    """The samples' log-probs == the full sequence's at the sampling temperature (greedy, 0: the model's own)."""
    with FAMILIES[family]["reference"](), torch.no_grad():
        reference = full_sequence_logprobs(model, prompt, result.response_ids, temperature=temperature or 1.0)
    for member, (got, want) in enumerate(zip(result.logprobs, reference, strict=True)):
        assert got.dtype == torch.float64 and got.shape == want.shape
        error = _relative(got, want)
        assert error <= TOL, f"sample {member}: relative error {error:.3e}"


def _transformers_greedy(model, prompt, max_new, eos=None):
    model.generation_config.eos_token_id = None  # the config's default eos (GLM's 1) would stop it early
    out = model.generate(prompt.unsqueeze(0), max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
                         pad_token_id=0)
    return out[0, prompt.numel():]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers_generate(models, family):
    model, prompt = models[family], _prompt(family)
    with FAMILIES[family]["reference"]():
        ours = generate(model, prompt, 2, 12, temperature=0, longstraw=FAMILIES[family]["longstraw"])
        want = _transformers_greedy(model, prompt, 12)
    assert ours.size == 2
    for ids in ours.response_ids:  # greedy: every sample is the same
        assert ids.dtype == torch.long and torch.equal(ids, want), (ids.tolist(), want.tolist())
    assert ours.finished == [False, False]
    _assert_logprobs(model, family, prompt, ours)


@pytest.mark.parametrize("family", FAMILIES)
def test_eos_stops_a_sample_like_transformers(models, family):
    """eos = the 5th greedy token (not among the first 4): both decoders stop right after it."""
    model, prompt = models[family], _prompt(family, seed=2)
    with FAMILIES[family]["reference"]():
        free = generate(model, prompt, 1, 10, temperature=0, longstraw=FAMILIES[family]["longstraw"]).response_ids[0]
        position = next(i for i in range(4, 10) if int(free[i]) not in free[:i].tolist())
        eos = int(free[position])
        ours = generate(model, prompt, 1, 10, temperature=0, eos_token_id=[96, eos],
                        longstraw=FAMILIES[family]["longstraw"])
        want = _transformers_greedy(model, prompt, 10, eos=eos)
    assert torch.equal(ours.response_ids[0], free[: position + 1])
    assert torch.equal(ours.response_ids[0], want[: position + 1]) and (want[position + 1:] == 0).all()
    assert ours.finished == [True] and ours.logprobs[0].numel() == position + 1


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9), (1.3, 0.05)],
                         ids=["t1", "t0.7-p0.9", "t1.3-p0.05"])
def test_sampled_logprobs_equal_full_sequence(models, family, temperature, top_p):
    """Log-probs at the sampling temperature (logits / temperature), whatever the nucleus (no top-p truncation);
    G = 3, responses of 1..7 tokens."""
    model, prompt = models[family], _prompt(family)
    with FAMILIES[family]["reference"]():
        result = generate(model, prompt, 3, 7, temperature=temperature, top_p=top_p, seed=5,
                          longstraw=FAMILIES[family]["longstraw"])
        one_token = generate(model, prompt, 1, 1, temperature=temperature, top_p=top_p, seed=5,
                             longstraw=FAMILIES[family]["longstraw"])
    assert [ids.numel() for ids in result.response_ids] == [7, 7, 7]
    _assert_logprobs(model, family, prompt, result, temperature)
    _assert_logprobs(model, family, prompt, one_token, temperature)
    assert torch.equal(one_token.response_ids[0], result.response_ids[0][:1])  # sample 0's stream, whatever G


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.8, top_p=0.9, seed=3),
                                      dict(seed=1, eos_token_id=list(range(0, 97, 4)))],
                         ids=["greedy", "sampled", "eos-drops-out"])
@pytest.mark.parametrize("tier", ["none", "cpu"])
def test_batched_decode_equals_one_sample_at_a_time(models, family, sampling, tier):
    """batched (one forward per step for all samples, finished ones leaving the batch) == batched=False (the plain
    reference: each sample alone through the segment forward): the same tokens, log-probs within 1e-10 (float64;
    measured ~1e-15: only the order of the attention's partial merges differs). G = 5, up to 8 tokens; with eos
    ids a quarter of the vocabulary, samples end at different steps. glm_moe_dsa: index_topk 8 < 44 prompt keys,
    so each sample's selection mixes prompt rows and its own rows."""
    model, prompt = models[family], _prompt(family)
    config = dict(FAMILIES[family]["longstraw"], offload={"tier": tier})
    assert hasattr(rollout.adapter_for(model), "decode_step")
    with FAMILIES[family]["reference"]():
        batched = generate(model, prompt, 5, 8, longstraw=config, **sampling)
        each = generate(model, prompt, 5, 8, longstraw=config, batched=False, **sampling)
    assert batched.finished == each.finished
    if "eos_token_id" in sampling:
        assert len({ids.numel() for ids in each.response_ids}) > 1  # samples left the batch at different steps
    for a, b in zip(batched.response_ids, each.response_ids, strict=True):
        assert torch.equal(a, b), (a.tolist(), b.tolist())
    for a, b in zip(batched.logprobs, each.logprobs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    _assert_logprobs(model, family, prompt, batched, sampling.get("temperature", 1.0))


def test_top_p_keeps_the_nucleus():
    """A tiny nucleus (top_p 1e-6) is the most probable token alone: the
    sample then equals greedy decoding."""
    model, prompt = tiny_qwen3_5(), _prompt("qwen3_5")
    with float64_model():
        nucleus = generate(model, prompt, 2, 6, top_p=1e-6, seed=3, longstraw=FAMILIES["qwen3_5"]["longstraw"])
        greedy = generate(model, prompt, 1, 6, temperature=0, longstraw=FAMILIES["qwen3_5"]["longstraw"])
    for ids in nucleus.response_ids:
        assert torch.equal(ids, greedy.response_ids[0])


def test_sample_by_inverse_cdf():
    """_sample on known distributions: the uniform picks by cumulative probability over sorted tokens."""
    logits = torch.log(torch.tensor([0.1, 0.5, 0.15, 0.25], dtype=torch.float64))
    # sorted: 1 (0.5), 3 (0.25), 2 (0.15), 0 (0.1); cumulative 0.5, 0.75, 0.9, 1.0
    picks = [rollout._sample(logits, 1.0, 1.0, u) for u in (0.0, 0.49, 0.51, 0.74, 0.76, 0.89, 0.91, 0.999)]
    assert picks == [1, 1, 3, 3, 2, 2, 0, 0]
    # top_p 0.7: the nucleus is {1, 3} (0.5 < 0.7 <= 0.75), renormalised: 1 below 2/3, 3 above
    assert [rollout._sample(logits, 1.0, 0.7, u) for u in (0.6, 0.7, 0.999)] == [1, 3, 3]
    # temperature 0.5 squares the probabilities: 0.25, 0.0625, 0.0225, 0.01 over 0.345; 1 below 0.7246
    assert [rollout._sample(logits, 0.5, 1.0, u) for u in (0.72, 0.73)] == [1, 3]
    assert rollout._sample(logits, 0, 1.0, 0.99) == 1  # greedy ignores the uniform


def test_seed_reproduces_the_samples(models):
    model, prompt = models["qwen3_5"], _prompt("qwen3_5")
    config = FAMILIES["qwen3_5"]["longstraw"]
    with float64_model():
        first = generate(model, prompt, 3, 6, seed=7, longstraw=config)
        again = generate(model, prompt, 3, 6, seed=7, longstraw=config)
        other = generate(model, prompt, 3, 6, seed=8, longstraw=config)
        drawn = generate(model, prompt, 2, 6, longstraw=config)
        redrawn = generate(model, prompt, 2, 6, seed=drawn.seed, longstraw=config)
    assert first.seed == 7
    for a, b in zip(first.response_ids, again.response_ids, strict=True):
        assert torch.equal(a, b)
    assert all(not torch.equal(a, b) for a, b in zip(first.response_ids, other.response_ids, strict=True))
    assert len({tuple(ids.tolist()) for ids in first.response_ids}) == 3  # samples differ from each other
    for a, b in zip(drawn.response_ids, redrawn.response_ids, strict=True):
        assert torch.equal(a, b)


def test_sampled_eos_ends_each_sample(models):
    """Several eos ids, near-uniform sampling: each sample ends at its first eos, or runs to max_new_tokens."""
    model, prompt = models["qwen3_5"], _prompt("qwen3_5")
    eos = list(range(0, 97, 4))  # a quarter of the vocabulary: most samples end within a few tokens
    with float64_model():
        result = generate(model, prompt, 6, 9, seed=1, eos_token_id=eos, longstraw=FAMILIES["qwen3_5"]["longstraw"])
    assert any(result.finished)
    for ids, ended, logps in zip(result.response_ids, result.finished, result.logprobs, strict=True):
        inside = [int(t) in eos for t in ids[:-1]]
        assert not any(inside)
        assert ended == (int(ids[-1]) in eos)
        assert ended or ids.numel() == 9
        assert logps.numel() == ids.numel()
    _assert_logprobs(model, "qwen3_5", prompt, result)


@pytest.mark.parametrize("family", FAMILIES)
def test_host_tier_equals_device_tier(models, family):
    model, prompt = models[family], _prompt(family)
    config = FAMILIES[family]["longstraw"]
    with FAMILIES[family]["reference"]():
        device = generate(model, prompt, 2, 6, temperature=0.9, seed=4, longstraw=config)
        host = generate(model, prompt, 2, 6, temperature=0.9, seed=4, longstraw=dict(config, offload={"tier": "cpu"}))
    for a, b in zip(device.response_ids, host.response_ids, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(device.logprobs, host.logprobs, strict=True):
        assert _relative(b, a) <= TOL


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_group_trains_on_the_samples(models, temperature):
    """Rollouts.group(rewards) is a GRPOGroup whose old log-probs are the samples'; the transaction's replay of those
    samples gives the same log-probs (detached mode: the same captured state, the same weights), the objective
    scoring at the temperature the samples were drawn at."""
    model, prompt = models["qwen3_5"], _prompt("qwen3_5")
    config = FAMILIES["qwen3_5"]["longstraw"]
    with float64_model():
        result = generate(model, prompt, 3, 5, seed=2, longstraw=config, temperature=temperature)
        group = result.group([1.0, 0.0, 0.5])
        model.zero_grad(set_to_none=True)
        trained = grpo_backward(model, group, GRPOObjective(temperature=temperature), longstraw=config)
        model.zero_grad(set_to_none=True)
    assert isinstance(result, Rollouts) and group.size == 3
    assert torch.equal(group.prompt_ids, prompt)
    for old, replayed, sampled in zip(group.old_logprobs, trained.logprobs, result.logprobs, strict=True):
        assert torch.equal(old, sampled)
        assert _relative(replayed, sampled) <= TOL
    assert result.phases["capture"].seconds > 0 and result.phases["decode"].seconds > 0


def test_training_config_and_peft_policy(models):
    """generate takes the training run's config block as it is (exact mode, kept attention, a small prefix_block:
    nothing is kept for a prefix pass) and a peft LoRA policy (zero-initialised B: the base model's samples)."""
    import peft

    model, prompt = models["qwen3_5"], _prompt("qwen3_5")
    policy = peft.get_peft_model(tiny_qwen3_5(), peft.LoraConfig(r=4, target_modules=["q_proj", "in_proj_qkv"]))
    exact = dict(FAMILIES["qwen3_5"]["longstraw"], prefix_grad="exact", prefix_keep_attention=True, prefix_block=2)
    with float64_model():
        plain = generate(model, prompt, 2, 5, seed=9, longstraw=FAMILIES["qwen3_5"]["longstraw"])
        trained = generate(model, prompt, 2, 5, seed=9, longstraw=exact)
        lora = generate(policy, prompt, 2, 5, seed=9, longstraw=FAMILIES["qwen3_5"]["longstraw"])
    for other in (trained, lora):
        for a, b in zip(plain.response_ids, other.response_ids, strict=True):
            assert torch.equal(a, b)
        for a, b in zip(plain.logprobs, other.logprobs, strict=True):
            assert _relative(b, a) <= TOL


CP_CASES = [
    dict(name="qwen-sampled", family="qwen3_5", prompt_len=23, samples=3, max_new=7,
         longstraw={"capture_chunk": 4, "page_tokens": 3}, sampling=dict(temperature=0.8, top_p=0.9, seed=11)),
    dict(name="qwen-host-eos", family="qwen3_5", prompt_len=20, samples=4, max_new=6, seed=3,
         longstraw={"capture_chunk": 5, "page_tokens": 4, "offload": {"tier": "cpu"}, "cp_replay": "spread"},
         sampling=dict(seed=2, eos_token_id=list(range(0, 97, 5)))),
    dict(name="glm-sampled", family="glm_moe_dsa", prompt_len=45, samples=2, max_new=6,
         longstraw={"capture_chunk": 7, "page_tokens": 4}, sampling=dict(seed=4, top_p=0.95)),
    dict(name="glm-greedy", family="glm_moe_dsa", prompt_len=41, samples=1, max_new=9, seed=5,
         longstraw={"capture_chunk": 6, "page_tokens": 5}, sampling=dict(temperature=0)),
    # the on-policy step under CP 2: every rank trains on its own kept shard (detached; exact, host tier; GLM exact)
    dict(name="qwen-train-detached", family="qwen3_5", prompt_len=21, samples=3, max_new=5, rewards=[1.0, 0.0, 0.4],
         longstraw={"capture_chunk": 4, "page_tokens": 3}, sampling=dict(seed=6)),
    dict(name="qwen-train-exact", family="qwen3_5", prompt_len=22, samples=2, max_new=4, rewards=[0.0, 1.0],
         longstraw={"capture_chunk": 4, "page_tokens": 3, "prefix_grad": "exact", "offload": {"tier": "cpu"}},
         sampling=dict(seed=8)),
    dict(name="glm-train-exact", family="glm_moe_dsa", prompt_len=37, samples=2, max_new=4, rewards=[1.0, 0.2],
         longstraw={"capture_chunk": 6, "page_tokens": 4, "prefix_grad": "exact"}, sampling=dict(seed=9)),
]


@pytest.fixture(scope="module")
def cp_results(tmp_path_factory):
    return run_rollouts(CP_CASES, str(tmp_path_factory.mktemp("cp_rollouts")))


@pytest.mark.parametrize("case", CP_CASES, ids=[case["name"] for case in CP_CASES])
def test_cp2_equals_one_rank(cp_results, case):
    """Every rank of CP 2 gets the single-process samples (prompt shards 11/11, 10/9, 22/22, 20/20 tokens);
    "cp_replay": "spread" in the config decodes as "replicated" does (every rank decodes every sample), and "auto"
    at these sizes decodes over the pages gathered once: nothing but the pages and the sampled tokens crosses
    ranks (a partial exchanged per layer and token would name its op here)."""
    reference = case_rollouts(case)
    ranks = cp_results[case["name"]]
    assert len({result["seed"] for result in ranks}) == 1  # a drawn seed too: the first rank's
    for rank, result in enumerate(ranks):
        assert result["finished"] == reference.finished
        if "seed" in case["sampling"]:
            assert result["seed"] == reference.seed
        for member, (got, want) in enumerate(zip(result["response_ids"], reference.response_ids, strict=True)):
            assert torch.equal(got, want), f"rank {rank} sample {member}: {got.tolist()} != {want.tolist()}"
        for member, (got, want) in enumerate(zip(result["logprobs"], reference.logprobs, strict=True)):
            assert _relative(got, want) <= TOL, f"rank {rank} sample {member}"
    _assert_logprobs(case_model(case)[0], case["family"], case_prompt(case), reference,
                     case["sampling"].get("temperature", 1.0))
    if "rewards" not in case:  # one exchange of the first rank's tokens per decode step for all the samples
        steps = max(len(ids) for ids in reference.response_ids)
        drawn_seed = "seed" not in case["sampling"]
        assert all(result["token_exchanges"] == steps + drawn_seed for result in ranks), ranks
        gathered = case["longstraw"].get("cp_replay", "auto") == "auto"
        for result in ranks:
            ops = set(result["decode_ops"])
            if gathered:
                assert ops <= {"gather_pages", "rollout_token"} and "gather_pages" in ops, ops
            else:
                assert "gather_pages" not in ops and ops - {"rollout_token"}, ops


TRAIN_CASES = [case for case in CP_CASES if "rewards" in case]


@pytest.mark.parametrize("case", TRAIN_CASES, ids=[case["name"] for case in TRAIN_CASES])
def test_cp2_training_reuses_each_ranks_capture(cp_results, case):
    """CP 2, generate(keep_capture) then grpo_backward(capture=rollouts) on every rank == one process's
    generate then grpo_backward with its own capture: gradients within relative L2 1e-10 (float64; the CP sides merge
    attention partials by LSE and scan the GDN carry across ranks: measured ~1e-15), and no capture in the
    transaction on any rank."""
    from cp_scripts.rollout_ranks import case_train
    from grads import relative_l2

    _, want, trained = case_train(case, reuse=False)
    assert not trained.extras["capture_reused"] and "capture" in trained.phases
    for rank, result in enumerate(cp_results[case["name"]]):
        assert result["extras"]["capture_reused"] and "capture" not in result["extras"]["phases"]
        error = relative_l2(result["grads"], want)
        assert error <= 1e-10, f"rank {rank}: relative L2 {error:.3e}"


@pytest.mark.parametrize("arguments,name", [
    (dict(prompt_ids=[5]), "prompt_ids"),
    (dict(prompt_ids=[[1, 2]]), "prompt_ids"),
    (dict(prompt_ids=[1.0, 2.0]), "prompt_ids"),
    (dict(prompt_ids=[1, 200]), "prompt_ids"),
    (dict(num_samples=0), "num_samples"),
    (dict(num_samples=2.0), "num_samples"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(eos_token_id=-1), "eos_token_id"),
    (dict(eos_token_id=[3, 97]), "eos_token_id"),
    (dict(eos_token_id="x"), "eos_token_id"),
    (dict(seed=-3), "seed"),
    (dict(longstraw={"page_tokens": 0}), "page_tokens"),
    (dict(longstraw={"cp_size": 2}), "cp_size"),
], ids=lambda value: value if isinstance(value, str) else None)
def test_bad_arguments_are_refused_by_name(models, arguments, name):
    call = dict(prompt_ids=[1, 2, 3], num_samples=1, max_new_tokens=2)
    call.update(arguments)
    with pytest.raises(ValueError, match=name):
        generate(models["qwen3_5"], call.pop("prompt_ids"), call.pop("num_samples"), call.pop("max_new_tokens"),
                 **call)


def test_lockstep_arguments_are_refused_by_name(models):
    """dp_group and a precomputed lockstep are two ways to say one thing; an idle slot's lockstep decodes no prompt
    (decode_idle_slot runs it). Both refused before any collective."""
    from ds_longstraw.rollout.decode_lockstep import DecodeLockstep

    with pytest.raises(ValueError, match="dp_group or lockstep"):
        generate(models["qwen3_5"], [1, 2, 3], 1, 2, dp_group=object(), lockstep=Lockstep(
            GroupCalls(1, ()), GroupCalls(1, ()), parse_config(None)))
    idle = DecodeLockstep(1, 1, 1, parse_config(None), group=None, idle=True)
    with pytest.raises(ValueError, match="idle slot"):
        generate(models["qwen3_5"], [1, 2, 3], 1, 2, lockstep=idle)


# -- memory: decoding G samples costs what one costs ------------------------------------------------------------------
# Each configuration runs in a fresh process (tests/unit/test_memory.py's method): the small shape, float32, one thread,
# MALLOC_MMAP_THRESHOLD_ so freed memory is handed back; the figure is the kernel's high-water mark (VmHWM) over
# the generate call minus the resident set before it. `python test_rollout.py --peak PROMPT SAMPLES NEW`
# prints one configuration's figures as JSON (BENCHMARKS.md "Rollouts").
PEAK_PROMPT, PEAK_NEW = 16384, 32


def generate_peak(prompt_tokens, samples, new_tokens):
    """In this process: the figures of one generate call on the small shape (to be run in a fresh process)."""
    import time

    from ds_longstraw.grpo.memory import host_current_bytes, host_peak_bytes, reset_host_peak, return_freed_host_memory
    from ds_longstraw.models.shapes import build_named

    model = build_named("small")
    prompt = torch.randint(0, model.config.vocab_size, (prompt_tokens,), generator=torch.Generator().manual_seed(0))
    return_freed_host_memory("cpu")
    before = host_current_bytes()
    reset_host_peak()
    start = time.perf_counter()
    result = generate(model, prompt, samples, new_tokens, seed=0, longstraw={"capture_chunk": 1024, "page_tokens": 256})
    seconds = time.perf_counter() - start
    # generate's PhaseMeter resets VmHWM at each phase start: the call's peak is the largest phase's
    peak = max([host_peak_bytes()] + [stats.peak_bytes for stats in result.phases.values()])
    return {"prompt": prompt_tokens, "samples": samples, "new_tokens": new_tokens, "step_peak_bytes": peak - before,
            "process_peak_bytes": peak, "decode_peak_bytes": result.phases["decode"].peak_bytes - before,
            "capture_seconds": result.phases["capture"].seconds, "decode_seconds": result.phases["decode"].seconds,
            "seconds": seconds, "tokens": sum(ids.numel() for ids in result.response_ids)}


def fresh_generate_peak(prompt_tokens, samples, new_tokens):
    import json
    import os
    import subprocess
    import sys

    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the helpers' folder (models.py)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="1048576", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, __file__, "--peak", str(prompt_tokens), str(samples), str(new_tokens)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_decode_peak_flat_in_samples():
    """G = 8 samples of 32 tokens from a 16K-token prompt peak at most 1.1x one sample's (the issue's bound): the
    samples' steps decode as one batch reading the one captured state, each with only its own carry and rows."""
    one = fresh_generate_peak(PEAK_PROMPT, 1, PEAK_NEW)
    eight = fresh_generate_peak(PEAK_PROMPT, 8, PEAK_NEW)
    assert eight["tokens"] == 8 * one["tokens"] == 8 * PEAK_NEW  # no eos: every sample runs to the end
    ratio = eight["step_peak_bytes"] / one["step_peak_bytes"]
    assert ratio <= 1.1, f"G=8 peaks at {ratio:.3f}x G=1 ({eight['step_peak_bytes']} vs {one['step_peak_bytes']} B)"


if __name__ == "__main__":
    import json
    import sys

    if len(sys.argv) != 5 or sys.argv[1] != "--peak":
        raise SystemExit("usage: python tests/distributed/test_rollout.py --peak PROMPT_TOKENS SAMPLES NEW_TOKENS")
    torch.set_num_threads(1)
    print(json.dumps(generate_peak(*(int(value) for value in sys.argv[2:]))))


# -- the on-policy step: training reuses generate's capture ---------------------------------------------------------
# grpo_backward(group, capture=rollouts) == grpo_backward(group) (its own capture), detached and exact, gradients
# relative L2 <= 1e-12: both sides run the same float64 capture (same config, same chunks) and the same replay, so
# they agree bit for bit in practice; 1e-12 leaves room only for a reordering.
REUSE_TOL = 1e-12


def _reuse_config(mode, tier, tmp_path, monkeypatch=None, family="qwen3_5"):
    config = dict(FAMILIES[family]["longstraw"], prefix_grad=mode.removesuffix("-keep"),
                  prefix_keep_attention=mode.endswith("-keep"), prefix_block=5 if mode != "detached" else None)
    if tier == "cpu":
        config["offload"] = {"tier": "cpu"}
    elif tier == "nvme":
        _nvme_engine(monkeypatch)
        config["offload"] = {"tier": "nvme", "nvme_path": str(tmp_path), "aio": {"block_size": 4096,
                                                                                  "queue_depth": 4}}
    return config


def _nvme_engine(monkeypatch):
    """DeepSpeed's aio op where it builds, else buffered I/O (as on a filesystem that refuses O_DIRECT)."""
    from ds_longstraw.offload import io_engine

    try:
        io_engine.load_aio()
    except RuntimeError:
        monkeypatch.setattr("ds_longstraw.offload.nvme_pool.probe_direct_io", lambda directory: False)


def _counted_captures(monkeypatch):
    """Counts the policy captures (topology.capture on one rank)."""
    from ds_longstraw.grpo.topology import OneRank

    calls, capture = [], OneRank.capture

    def counting(self, *args, **kwargs):
        calls.append(args[1].numel())
        return capture(self, *args, **kwargs)

    monkeypatch.setattr(OneRank, "capture", counting)
    return calls


@pytest.mark.parametrize("family,mode,tier", [
    ("qwen3_5", "detached", "none"), ("qwen3_5", "exact", "none"), ("qwen3_5", "exact-keep", "cpu"),
    ("qwen3_5", "detached", "nvme"), ("qwen3_5", "exact", "nvme"),
    ("glm_moe_dsa", "detached", "cpu"), ("glm_moe_dsa", "exact", "nvme")])
def test_training_reuses_the_capture(models, family, mode, tier, tmp_path, monkeypatch):
    """generate(keep_capture) then grpo_backward(capture=rollouts): one capture in all (counted), the gradients of
    the transaction's own capture, and no page file left once the step is done."""
    from grads import grads_of, relative_l2

    model, prompt = models[family], _prompt(family)
    config = _reuse_config(mode, tier, tmp_path, monkeypatch, family)
    with FAMILIES[family]["reference"]():
        calls = _counted_captures(monkeypatch)
        rollouts = generate(model, prompt, 3, 5, seed=2, longstraw=config, keep_capture=True)
        assert rollouts.capture is not None and len(calls) == 1
        rollouts_group = rollouts.group([1.0, 0.0, 0.5])
        grads, result = grads_of(model, lambda: grpo_backward(model, rollouts_group, GRPOObjective(), longstraw=config,
                                                              capture=rollouts))
        assert len(calls) == 1 and rollouts.capture is None  # taken: no second capture
        assert result.extras["capture_reused"] and "capture" not in result.phases
        if tier != "none":
            assert list(tmp_path.iterdir()) == []  # released with the transaction
        want_grads, want = grads_of(model, lambda: grpo_backward(model, rollouts_group, GRPOObjective(),
                                                                 longstraw=config))
        assert len(calls) == 2 and not want.extras["capture_reused"]
        model.zero_grad(set_to_none=True)
    assert relative_l2(grads, want_grads) <= REUSE_TOL
    assert result.loss == pytest.approx(want.loss, rel=REUSE_TOL)
    for mine, theirs in zip(result.logprobs, want.logprobs, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=REUSE_TOL)
    if tier != "none":
        assert list(tmp_path.iterdir()) == []


def test_reuse_is_refused_when_it_does_not_fit(models, tmp_path, monkeypatch):
    """Refusals by name (and the capture released with each, its page files gone): weights changed by an optimizer
    step, another prompt, another capture config, a second use; release() and `with` drop an unused capture."""
    model, prompt = models["qwen3_5"], _prompt("qwen3_5")
    config = _reuse_config("detached", "nvme", tmp_path, monkeypatch)
    other = tiny_qwen3_5()
    with float64_model():
        def kept():
            return generate(model, prompt, 2, 3, seed=1, longstraw=config, keep_capture=True)

        rollouts = kept()
        group = rollouts.group([1.0, 0.0])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        for param in model.parameters():
            param.grad = torch.zeros_like(param)
        optimizer.step()  # lr 0: the values stay, the step happened all the same
        model.zero_grad(set_to_none=True)
        with pytest.raises(ValueError, match="weights changed"):
            grpo_backward(model, group, longstraw=config, capture=rollouts)
        assert rollouts.capture is None
        with pytest.raises(ValueError, match="no kept capture"):
            grpo_backward(model, group, longstraw=config, capture=rollouts)
        rollouts = kept()
        with pytest.raises(ValueError, match="prompt"):
            grpo_backward(model, rollouts_with_prompt(rollouts, prompt.flip(0)), longstraw=config, capture=rollouts)
        rollouts = kept()
        with pytest.raises(ValueError, match="page_tokens"):
            grpo_backward(model, rollouts.group([1.0, 0.0]), longstraw=dict(config, page_tokens=5), capture=rollouts)
        rollouts = kept()
        with pytest.raises(ValueError, match="another model"):
            grpo_backward(other, rollouts.group([1.0, 0.0]), longstraw=config, capture=rollouts)
        rollouts = kept()
        exact = dict(config, prefix_grad="exact")
        with pytest.raises(ValueError, match="prefix_grad"):
            grpo_backward(model, rollouts.group([1.0, 0.0]), longstraw=exact, capture=rollouts)
        # a transaction padding its capture (a lockstep's) takes only a capture padded alike under a decode lockstep
        rollouts = kept()
        group = rollouts.group([1.0, 0.0])
        longstraw = parse_config(config)
        local = calls_of(group, longstraw)
        padded = Lockstep(local, GroupCalls(local.chunks + 1, local.blocks), longstraw)
        refusal = rf"padded to {local.chunks + 1} chunks .* kept capture was padded to None"
        with pytest.raises(ValueError, match=refusal):
            grpo_backward(model, group, longstraw=config, capture=rollouts, lockstep=padded)
        assert rollouts.capture is None
        # replay-only keys may differ
        rollouts = kept()
        result = grpo_backward(model, rollouts.group([1.0, 0.0]), longstraw=dict(config, replay_block=2),
                               capture=rollouts)
        assert result.extras["capture_reused"]
        with kept() as unused:
            assert unused.capture is not None
        assert unused.capture is None
        kept().release()
        model.zero_grad(set_to_none=True)
        assert list(tmp_path.iterdir()) == []
        kept()  # dropped without release: garbage collection removes its files
        import gc

        gc.collect()
    assert list(tmp_path.iterdir()) == []


def rollouts_with_prompt(rollouts, prompt):
    from ds_longstraw import GRPOGroup

    return GRPOGroup(prompt, list(rollouts.response_ids), rewards=[1.0, 0.0])


def test_score_temperature_sets_the_old_logprobs_temperature(models):
    """generate(temperature=0.7, score_temperature=1.0): the same tokens, log-probs at temperature 1 (full-sequence
    log-softmax of the unscaled logits, 1e-8); rollout_samples passes it on, so a rollout block sampling at 2.0 for
    an objective at 1.0 (engine.grpo_step's case: the recall task's) gives old log-probs at 1.0; a bad value is
    refused by name."""
    from ds_longstraw.rollout.step import rollout_samples, sample_seed

    model, prompt = models["qwen3_5"], _prompt("qwen3_5")
    config = FAMILIES["qwen3_5"]["longstraw"]
    with float64_model():
        hot = generate(model, prompt, 2, 5, temperature=0.7, seed=3, longstraw=config)
        scored = generate(model, prompt, 2, 5, temperature=0.7, seed=3, longstraw=config, score_temperature=1.0)
        block = dict(source="internal", num_samples=2, max_new_tokens=4, temperature=2.0,
                     reward="rewards:mod3_reward", seed=1)
        (group, _), = rollout_samples(model, [prompt], block, step=0, longstraw=config, score_temperature=1.0)
        sampled = generate(model, prompt, 2, 4, temperature=2.0, seed=sample_seed(1, 0, 0), longstraw=config)
    assert all(torch.equal(a, b) for a, b in zip(hot.response_ids, scored.response_ids, strict=True))
    _assert_logprobs(model, "qwen3_5", prompt, hot, 0.7)
    _assert_logprobs(model, "qwen3_5", prompt, scored, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(group.response_ids, sampled.response_ids, strict=True))
    with float64_model(), torch.no_grad():
        want = full_sequence_logprobs(model, prompt, group.response_ids)
    for got, expected in zip(group.old_logprobs, want, strict=True):
        assert _relative(got, expected) <= TOL
    with pytest.raises(ValueError, match="score_temperature"):
        generate(model, prompt, 1, 2, score_temperature=0.0)
