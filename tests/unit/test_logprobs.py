"""Vocabulary-chunked log-probs (ds_longstraw.kernels.chunked_logprobs) against the full log-softmax.

Equivalence chains:
  chunked_logprobs (online log-sum-exp over chunks; backward recomputes each chunk) == logprobs_reference
      (log_softmax of the full [T, V] logits, then gather), values and gradients w.r.t. hidden, weight and bias,
      in float64 to 1e-12, for any chunk size (not dividing V, larger than V, one id);
  the adapter's chunked logprobs == its plain path (module call), and grpo_backward with chunks of 10 ids over the
      tiny model's 97 == grpo_backward on the plain path;
  under ZeRO-3 (2 gloo ranks, the LM head's weight partitioned): the engine's gradients with the chunked path ==
      single-process autograd through the reference.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from models import tiny_qwen3_5
from peft import LoraConfig, get_peft_model

from ds_longstraw.arch import adapter_for
from ds_longstraw.arch.base import CausalLMAdapter
from ds_longstraw.group import GRPOGroup
from ds_longstraw.grpo.transaction import grpo_backward
from ds_longstraw.kernels import chunked_logprobs, logprobs_reference
from ds_longstraw.kernels.logprobs import chunked as logprobs_module
from ds_longstraw.objective import GRPOObjective

# float64: the chunked and full computations differ only in summation order (per-chunk sums and rescaling):
# measured differences are a few 1e-16; 1e-12 leaves room for larger T and V without hiding a wrong term.
TOL64 = 1e-12


@pytest.fixture(autouse=True)
def poisoned_buffers(monkeypatch):
    """d(weight) and d(bias) start as NaN: a row that no chunk writes shows up."""
    monkeypatch.setattr(logprobs_module, "_uninitialised", lambda t: torch.full_like(t, float("nan")))


def _inputs(tokens, vocab, channels=24, dtype=torch.float64, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, channels, generator=gen, dtype=torch.float64)
    weight = torch.randn(vocab, channels, generator=gen, dtype=torch.float64) * 0.5
    bias_v = torch.randn(vocab, generator=gen, dtype=torch.float64) if bias else None
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    # The first and last vocabulary ids are targets whatever the draw.
    targets[0] = 0
    targets[-1] = vocab - 1
    leaves = [t.to(dtype).requires_grad_() if t is not None else None for t in (hidden, weight, bias_v)]
    return (*leaves, targets, torch.randn(tokens, generator=gen, dtype=torch.float64).to(dtype))


def _values_and_grads(fn, hidden, weight, bias, targets, dlogp, **kwargs):
    for t in (hidden, weight, bias):
        if t is not None:
            t.grad = None
    logp = fn(hidden, weight, targets, bias, **kwargs)
    (logp * dlogp).sum().backward()
    return logp.detach(), [None if t is None else t.grad.clone() for t in (hidden, weight, bias)]


CASES = {  # id: (tokens, vocab, chunk)
    "chunk-not-dividing-V": (7, 50, 16),
    "odd-sizes": (63, 111, 17),
    "chunk-larger-than-V": (5, 50, 64),
    "chunk-equals-V": (5, 50, 50),
    "one-id-chunks": (4, 9, 1),
    "T=1": (1, 33, 8),
}


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_float64_values_and_gradients_match_full_log_softmax(case, bias):
    tokens, vocab, chunk = CASES[case]
    hidden, weight, bias_v, targets, dlogp = _inputs(tokens, vocab, bias=bias)
    got, got_grads = _values_and_grads(chunked_logprobs, hidden, weight, bias_v, targets, dlogp, vocab_chunk=chunk)
    want, want_grads = _values_and_grads(logprobs_reference, hidden, weight, bias_v, targets, dlogp)
    assert got.dtype == torch.float64 and got.shape == (tokens,)
    torch.testing.assert_close(got, want, rtol=0, atol=TOL64)
    for name, g, w in zip(("hidden", "weight", "bias"), got_grads, want_grads, strict=True):
        if w is None:
            assert g is None, name
            continue
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g, w, rtol=0, atol=TOL64, msg=lambda m, name=name: f"d{name}: {m}")


def test_only_needed_gradients_are_computed():
    """A frozen head (weight without grad): d(hidden) only, and no d(weight) buffer is made."""
    hidden, weight, _, targets, dlogp = _inputs(6, 40, bias=False)
    weight = weight.detach()
    logp = chunked_logprobs(hidden, weight, targets, vocab_chunk=7)
    (logp * dlogp).sum().backward()
    want = logprobs_reference(hidden.detach().requires_grad_(), weight, targets)
    assert weight.grad is None
    torch.testing.assert_close(logp, want, rtol=0, atol=TOL64)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_frozen_head_direction_in_forward_matches_full_log_softmax(case, bias, monkeypatch):
    """A frozen head: the forward computes d log p / d hidden (target row minus softmax-expected row) and the
    backward only scales it by dlogp. Values and d(hidden) equal the reference's in float64, and backward computes
    no logits (counted): a backward that silently fell back to recomputing would pass the values but not this."""
    tokens, vocab, chunk = CASES[case]
    hidden, weight, bias_v, targets, dlogp = _inputs(tokens, vocab, bias=bias)
    weight = weight.detach()
    bias_v = None if bias_v is None else bias_v.detach()
    calls = []
    chunk_logits = logprobs_module._chunk_logits
    monkeypatch.setattr(logprobs_module, "_chunk_logits", lambda *a: calls.append(1) or chunk_logits(*a))
    got = chunked_logprobs(hidden, weight, targets, bias_v, vocab_chunk=chunk)
    forward_calls = len(calls)
    (got_grad,) = torch.autograd.grad((got * dlogp).sum(), hidden)
    assert len(calls) == forward_calls == -(-vocab // chunk)
    reference_hidden = hidden.detach().requires_grad_()
    want = logprobs_reference(reference_hidden, weight, targets, bias_v)
    (want_grad,) = torch.autograd.grad((want * dlogp).sum(), reference_hidden)
    torch.testing.assert_close(got, want, rtol=0, atol=TOL64)
    torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=TOL64)


def test_frozen_head_float32_within_twice_the_plain_error():
    """float32 with a frozen head: d(hidden) from the forward's direction is within 2x the plain float32 path's
    error against float64 (plus 1 ulp of the gradient's scale), as the recomputing backward is."""
    hidden, weight, bias_v, targets, dlogp = _inputs(37, 3001, channels=64)
    reference_hidden = hidden.detach().requires_grad_()
    exact = logprobs_reference(reference_hidden, weight.detach(), targets, bias_v.detach())
    (exact_grad,) = torch.autograd.grad((exact * dlogp).sum(), reference_hidden)
    grads = {}
    for name, fn in (("chunked", chunked_logprobs), ("plain", logprobs_reference)):
        low = hidden.detach().float().requires_grad_()
        logp = fn(low, weight.detach().float(), targets, bias_v.detach().float(), vocab_chunk=512)
        (grads[name],) = torch.autograd.grad((logp * dlogp.float()).sum(), low)
    floor = torch.finfo(torch.float32).eps * exact_grad.abs().max().item()
    c_err = (grads["chunked"].double() - exact_grad).abs().max().item()
    p_err = (grads["plain"].double() - exact_grad).abs().max().item()
    assert c_err <= 2 * p_err + floor, f"chunked error {c_err:.3g} vs plain {p_err:.3g}"


def test_large_logits_do_not_overflow():
    """Logits of +-1e4: the running max keeps exp() in range (a plain sum of exp would overflow)."""
    hidden, weight, bias_v, targets, dlogp = _inputs(9, 70)
    with torch.no_grad():
        bias_v.mul_(1e4)
    got, got_grads = _values_and_grads(chunked_logprobs, hidden, weight, bias_v, targets, dlogp, vocab_chunk=16)
    want, want_grads = _values_and_grads(logprobs_reference, hidden, weight, bias_v, targets, dlogp)
    # logp of order -1e4: float64 keeps ~1e-12 relative, so compare relative to the magnitude.
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-9)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=TOL64)


def test_float32_within_twice_the_plain_error():
    """float32 inputs: the chunked error against float64 is at most 2x the plain float32 path's (plus 1 ulp of
    the log-probs' scale), for values and every gradient. Measured: ratios 0.9-1.3."""
    hidden, weight, bias_v, targets, dlogp = _inputs(37, 3001, channels=64)
    exact, exact_grads = _values_and_grads(logprobs_reference, hidden, weight, bias_v, targets, dlogp)
    low = [t.detach().float().requires_grad_() for t in (hidden, weight, bias_v)]
    chunked, chunked_grads = _values_and_grads(chunked_logprobs, *low, targets, dlogp.float(), vocab_chunk=512)
    plain, plain_grads = _values_and_grads(logprobs_reference, *low, targets, dlogp.float())
    assert chunked.dtype == torch.float32
    pairs = [("logp", chunked, plain, exact)] + list(zip(("hidden", "weight", "bias"), chunked_grads, plain_grads,
                                                        exact_grads, strict=True))
    for name, c, p, e in pairs:
        c_err = (c.double() - e).abs().max().item()
        p_err = (p.double() - e).abs().max().item()
        floor = torch.finfo(torch.float32).eps * e.abs().max().item()
        assert c_err <= 2 * p_err + floor, f"{name}: chunked error {c_err:.3g} vs plain {p_err:.3g}"


def _tempered_log_softmax(hidden, weight, targets, bias, temperature):
    """The sampler's log-probs as TRL scores them (its _get_per_token_logps_and_entropies): the logits divided by
    the temperature, log_softmax, gather; written here, not the kernel module's reference."""
    logits = torch.nn.functional.linear(hidden, weight, bias) / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("frozen", [False, True], ids=["trained-head", "frozen-head"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_temperature_values_and_gradients_match_tempered_log_softmax(temperature, bias, frozen):
    """log softmax(z / tau) over 63 tokens and 111 ids in chunks of 17, values and every gradient (a frozen head:
    d(hidden) from the forward's direction), float64 to TOL64 (only the summation order differs). tau = 0.7 and
    1.3 bracket 1, so a missing 1 / tau on either the logits or the gradient is off by ~40%."""
    hidden, weight, bias_v, targets, dlogp = _inputs(63, 111, bias=bias)
    if frozen:
        weight = weight.detach()
        bias_v = None if bias_v is None else bias_v.detach()
    leaves = [t for t in (hidden, weight, bias_v) if t is not None and t.requires_grad]

    def values_and_grads(fn, **kwargs):
        logp = fn(hidden, weight, targets, bias_v, temperature=temperature, **kwargs)
        return logp.detach(), torch.autograd.grad((logp * dlogp).sum(), leaves)

    got, got_grads = values_and_grads(chunked_logprobs, vocab_chunk=17)
    want, want_grads = values_and_grads(_tempered_log_softmax)
    plain, _ = values_and_grads(logprobs_reference)
    torch.testing.assert_close(got, want, rtol=0, atol=TOL64)
    torch.testing.assert_close(plain, want, rtol=0, atol=TOL64)
    assert len(got_grads) == (1 if frozen else 3 if bias else 2)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=TOL64)
    untempered = chunked_logprobs(hidden, weight, targets, bias_v, vocab_chunk=17).detach()
    assert (untempered - want).abs().max() > 1e-2  # the check can fail: tau changes the log-probs


def test_input_checks():
    hidden, weight, _, targets, _ = _inputs(4, 10, bias=False)
    with pytest.raises(ValueError, match="vocab_chunk"):
        chunked_logprobs(hidden, weight, targets, vocab_chunk=0)
    with pytest.raises(ValueError, match="shapes do not match"):
        chunked_logprobs(hidden, weight, targets[:3])
    with pytest.raises(ValueError, match="expected hidden"):
        chunked_logprobs(hidden.unsqueeze(0), weight, targets)
    with pytest.raises(ValueError, match=r"bias: expected \[10\], got \(9,\)"):
        chunked_logprobs(hidden, weight, targets, torch.zeros(9, dtype=hidden.dtype))
    for bad in (0.0, -0.5, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match=f"temperature must be a finite number > 0.*got {bad!r}"):
            chunked_logprobs(hidden, weight, targets, temperature=bad)


# ---- the adapter path -------------------------------------------------------------------------------------------


def _adapter_logprobs_and_grads(model, chunk, monkeypatch, hidden, targets):
    monkeypatch.setattr(CausalLMAdapter, "logprobs_vocab_chunk", chunk)
    model.zero_grad(set_to_none=True)
    hidden = hidden.detach().requires_grad_()
    logp = adapter_for(model).logprobs(hidden, targets)
    (logp * torch.linspace(-1, 1, logp.numel(), dtype=logp.dtype)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), hidden.grad, grads


def test_adapter_chunked_equals_plain_path(monkeypatch):
    model = tiny_qwen3_5()
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, 13, model.config.hidden_size, generator=gen, dtype=torch.float64)
    targets = torch.tensor([0, 96] + torch.randint(0, 97, (11,), generator=gen).tolist())
    outputs = []  # both paths are module calls of the head (ZeRO-3's hooks); only the plain one makes logits
    model.lm_head.register_forward_hook(lambda module, args, out: outputs.append(tuple(out.shape)))
    got, got_dh, got_grads = _adapter_logprobs_and_grads(model, 10, monkeypatch, hidden, targets)
    assert outputs == [(13,)] and "forward" not in vars(model.lm_head)
    want, want_dh, want_grads = _adapter_logprobs_and_grads(model, None, monkeypatch, hidden, targets)
    assert outputs == [(13,), (1, 13, 97)]
    torch.testing.assert_close(got, want, rtol=0, atol=TOL64)
    torch.testing.assert_close(got_dh, want_dh, rtol=0, atol=TOL64)
    assert set(got_grads) == set(want_grads) == {"lm_head.weight", "model.norm.weight"}
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=0, atol=TOL64)


def test_lora_wrapped_head_takes_the_plain_path(monkeypatch):
    """peft replaces a targeted lm_head by its own module (not an nn.Linear): the module call runs, adapters and
    all, instead of the chunked path, which reads only a plain head's weight."""
    model = get_peft_model(tiny_qwen3_5(), LoraConfig(r=2, target_modules=["lm_head"], init_lora_weights=False))
    monkeypatch.setattr(CausalLMAdapter, "logprobs_vocab_chunk", 10)
    adapter = adapter_for(model)
    assert type(adapter.lm_head) is not torch.nn.Linear
    hidden = torch.randn(1, 5, model.config.hidden_size, dtype=torch.float64)
    targets = torch.tensor([0, 3, 50, 7, 96])
    logits = adapter.lm_head(adapter.body.norm(hidden))[0]
    want = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(adapter.logprobs(hidden, targets), want, rtol=0, atol=0)


def test_grpo_backward_chunked_equals_plain(monkeypatch):
    """The whole transaction (exact mode, 2 replay blocks per member) with 10-id chunks over 97 ids == plain."""
    gen = torch.Generator().manual_seed(3)
    group = GRPOGroup(torch.randint(0, 97, (11,), generator=gen),
                      [torch.randint(0, 97, (n,), generator=gen) for n in (5, 9)], rewards=[1.0, -0.5])
    config = {"prefix_grad": "exact", "capture_chunk": 4, "page_tokens": 4, "replay_block": 4}
    results = {}
    for chunk in (10, None):
        monkeypatch.setattr(CausalLMAdapter, "logprobs_vocab_chunk", chunk)
        model = tiny_qwen3_5()
        out = grpo_backward(model, group, GRPOObjective(), longstraw=config)
        results[chunk] = (out, {n: p.grad for n, p in model.named_parameters()})
    (got, got_grads), (want, want_grads) = results[10], results[None]
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=TOL64)
    for name, g in want_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=0, atol=TOL64, msg=lambda m, n=name: f"{n}: {m}")


def test_grpo_backward_with_a_frozen_head_takes_the_direction_path(monkeypatch):
    """A frozen LM head (training the body only, as LoRA on the body does): the transaction's log-probs take the
    forward's d(hidden) direction on every call that needs a gradient, and the body's gradients equal the plain
    path's in float64."""
    gen = torch.Generator().manual_seed(4)
    group = GRPOGroup(torch.randint(0, 97, (11,), generator=gen),
                      [torch.randint(0, 97, (n,), generator=gen) for n in (5, 9)], rewards=[1.0, -0.5])
    config = {"prefix_grad": "exact", "capture_chunk": 4, "page_tokens": 4, "replay_block": 4}
    frozen_calls = []
    frozen_head = logprobs_module._frozen_head
    monkeypatch.setattr(logprobs_module, "_frozen_head", lambda *a: frozen_calls.append(frozen_head(*a)) or
                        frozen_calls[-1])
    results = {}
    for chunk in (10, None):
        monkeypatch.setattr(CausalLMAdapter, "logprobs_vocab_chunk", chunk)
        model = tiny_qwen3_5()
        model.lm_head.weight.requires_grad_(False)
        grpo_backward(model, group, GRPOObjective(), longstraw=config)
        results[chunk] = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert frozen_calls and all(frozen_calls)  # 2 members x 2-3 replay blocks, every one with the direction
    for name, g in results[None].items():
        torch.testing.assert_close(results[10][name], g, rtol=0, atol=TOL64, msg=lambda m, n=name: f"{n}: {m}")


# ---- ZeRO-3 -----------------------------------------------------------------------------------------------------

ZERO3_SCRIPT = textwrap.dedent("""
    import os, sys
    import torch, torch.multiprocessing as mp

    def rank_main(rank, port, out):
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        import deepspeed, torch.distributed as dist
        from deepspeed.utils import safe_get_full_grad
        from ds_longstraw.arch.base import head_logprobs
        from ds_longstraw.kernels import logprobs_reference
        deepspeed.init_distributed(dist_backend="gloo")
        torch.manual_seed(0)

        class Head(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.proj = torch.nn.Linear(16, 16)
                self.lm_head = torch.nn.Linear(16, 45)

        x = torch.linspace(-1, 1, 7 * 16).reshape(7, 16)
        targets = torch.tensor([0, 44, 3, 17, 30, 8, 44])
        weights = torch.linspace(0.5, 1.5, 7)

        plain = Head()
        model = Head()
        model.load_state_dict(plain.state_dict())
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,
                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                  "zero_allow_untested_optimizer": True}
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                          config=config)
        head = engine.module.lm_head
        assert head.weight.numel() == 0, "the head's weight must be partitioned for this check"
        errors = []
        # Two steps: the second one's calls run after DeepSpeed has recorded its call trace (it prefetches along
        # it); the plain model takes the same SGD step in between.
        for step in range(2):
            plain.zero_grad()
            want = logprobs_reference(plain.proj(x), plain.lm_head.weight, targets, plain.lm_head.bias)
            (-(want * weights).sum()).backward()
            got = head_logprobs(head, engine.module.proj(x), targets, vocab_chunk=8)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got, want)
            assert head.weight.numel() == 0, "partitioned again after the forward"
            engine.backward(-(got * weights).sum())
            assert head.weight.numel() == 0, "partitioned again after the backward"
            for name, p in engine.module.named_parameters():
                full, ref = safe_get_full_grad(p), dict(plain.named_parameters())[name].grad
                errors.append(f"{name} {(full - ref).abs().max().item():.3g}")
                assert torch.allclose(full, ref, rtol=1e-5, atol=1e-6), (name, step)
            engine.step()
            with torch.no_grad():
                for p in plain.parameters():
                    p -= 0.1 * p.grad
        if rank == 0:
            with open(out, "w") as f:
                f.write("ok " + ", ".join(errors))
        dist.barrier()
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(rank_main, args=(int(sys.argv[1]), sys.argv[2]), nprocs=2)
""")


@pytest.mark.slow
def test_zero3_partitioned_head_gradients_match_single_process(tmp_path):
    """Two gloo ranks, ZeRO-3 with every parameter partitioned (persistence threshold 0): head_logprobs runs the
    chunked path inside the head's module call, whose hooks gather the weight in forward and again in backward,
    and the gradients DeepSpeed reduces equal single-process autograd through the full log-softmax (float32:
    1e-5 relative, summation order only)."""
    from dist_scripts.launching import free_port

    script = tmp_path / "zero3_logprobs.py"
    script.write_text(ZERO3_SCRIPT)
    out = tmp_path / "result.txt"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(script), str(free_port()), str(out)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert out.read_text().startswith("ok"), out.read_text()
