"""The paged Triton attention kernels against their float64 torch reference: out, lse, dq and the gradient pages.

Equivalence chain: Triton forward over pages (table, partial last page) == gather pages + partial_attention_reference
(float64); Triton backward from the merged (out, lse, delta) == gather + blockwise_grads_from_delta, scattered onto
the gradient pages by index_put (float64); paged_partial_attention (autograd) == plain autograd through the gather.

Without a GPU the kernels run under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1) on CPU
float32 tensors; the CUDA test compiles them (bfloat16 and float32) and is skipped elsewhere.
Tolerance in float32: 2e-5 absolute and relative. Both sides sum at most ~100 O(1) terms per entry; the kernel
accumulates in float32 (~6e-8 relative per step) with full-precision dots on float32 inputs; the observed error on
these sizes is ~1e-6.
"""

import os

import pytest
import torch

from ds_longstraw.kernels import dispatch, partial_attention_reference
from ds_longstraw.kernels.attention import attention_delta
from ds_longstraw.kernels.attention import triton_paged as paged

pytestmark = pytest.mark.triton

# The kernels run where Triton can run them: under the interpreter on CPU tensors, else compiled on CUDA ones.
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda" if torch.cuda.is_available() else None
kernels_run = pytest.mark.skipif(DEVICE is None, reason="neither the Triton interpreter nor a CUDA device")

F32_TOL = dict(rtol=2e-5, atol=2e-5)  # float32 accumulation, see the module docstring
TILES = (16, 16)  # the smallest tiles: several query and key blocks at these sizes (the interpreter is slow)
PAGE = 16
D = 16


def _pages(gen, pages, kv_heads, poison_beyond=None, table=None):
    """k, v pages [N, P, K, D]; pages the table does not name, and rows past `poison_beyond` tokens, are NaN: the
    kernel must never read them."""
    k = torch.randn(pages, PAGE, kv_heads, D, generator=gen)
    v = torch.randn(pages, PAGE, kv_heads, D, generator=gen)
    if table is not None:
        unnamed = torch.ones(pages, dtype=torch.bool)
        unnamed[table.long()] = False
        k[unnamed] = float("nan")
        v[unnamed] = float("nan")
        if poison_beyond is not None and poison_beyond % PAGE:
            last = table[poison_beyond // PAGE].item()
            k[last, poison_beyond % PAGE:] = float("nan")
            v[last, poison_beyond % PAGE:] = float("nan")
    return k.to(DEVICE), v.to(DEVICE)


def _case(seed, heads, kv_heads, tq, tokens, pages=7):
    gen = torch.Generator().manual_seed(seed)
    count = -(-tokens // PAGE)
    table = torch.randperm(pages, generator=gen)[:count].to(torch.int32)  # pages out of order
    k, v = _pages(gen, pages, kv_heads, poison_beyond=tokens, table=table)
    q = torch.randn(heads, tq, D, generator=gen).to(DEVICE)
    return gen, q, k, v, table.to(DEVICE)


def _grads_both(q, k, v, table, tokens, scale, causal_offset, gen, dlse=False, grad_table=None, grad_pages=None):
    """(Triton dq, dk pages, dv pages), (reference ...) from the reference's own (out, lse) and a random dout."""
    ref_out, ref_lse = paged.paged_attention_forward_reference(q.double(), k.double(), v.double(), table, tokens,
                                                               scale, causal_offset)
    dout = torch.randn(q.shape, generator=gen).to(DEVICE)
    dlse_HT = torch.randn(ref_lse.shape, generator=gen).to(DEVICE) if dlse else None
    delta = attention_delta(ref_out, dout.double(), None if dlse_HT is None else dlse_HT.double())
    pages = grad_pages if grad_pages is not None else k.shape[0]
    start = torch.randn(pages, PAGE, k.shape[2], D, generator=gen).to(DEVICE)  # earlier blocks' accumulation
    dk, dv = start.clone(), start.clone()
    dq = paged.paged_grads_from_delta_triton(q, k, v, table, tokens, ref_lse.float(), dout, delta.float(), scale,
                                             dk, dv, grad_table, causal_offset, blocks=TILES)
    ref_dk, ref_dv = start.double(), start.double()
    ref_dq = paged.paged_grads_from_delta_reference(q.double(), k.double(), v.double(), table, tokens, ref_lse,
                                                    dout.double(), delta, scale, ref_dk, ref_dv, grad_table,
                                                    causal_offset)
    return (dq, dk, dv), (ref_dq, ref_dk, ref_dv), start


@kernels_run
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (2, 2), (4, 1)], ids=["gqa2", "mha", "gqa4"])
@pytest.mark.parametrize("tq,tokens", [(37, 70), (5, 64), (16, 1)], ids=["tq37-tk70", "tq5-tk64", "tq16-tk1"])
def test_forward_and_grads_match_reference(heads, kv_heads, tq, tokens):
    gen, q, k, v, table = _case(tq * 100 + tokens + heads, heads, kv_heads, tq, tokens)
    out, lse = paged.paged_attention_forward_triton(q, k, v, table, tokens, 0.3, blocks=TILES)
    ref_out, ref_lse = paged.paged_attention_forward_reference(q.double(), k.double(), v.double(), table, tokens, 0.3)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, **F32_TOL)
    torch.testing.assert_close(lse.double(), ref_lse, **F32_TOL)
    (dq, dk, dv), (ref_dq, ref_dk, ref_dv), _ = _grads_both(q, k, v, table, tokens, 0.3, None, gen)
    torch.testing.assert_close(dq.double(), ref_dq, **F32_TOL)
    named = table.long()
    torch.testing.assert_close(dk[named].double(), ref_dk[named], **F32_TOL)
    torch.testing.assert_close(dv[named].double(), ref_dv[named], **F32_TOL)


@kernels_run
@pytest.mark.parametrize("causal_offset", [-5, 0, 20], ids=["off-5", "off0", "off20"])
def test_causal_offset_and_queries_without_keys(causal_offset):
    """Query i sees key j iff j <= i + offset; with offset -5 queries 0..4 see none: out 0, lse -inf, no gradient."""
    gen, q, k, v, table = _case(11, 4, 2, 37, 45)
    out, lse = paged.paged_attention_forward_triton(q, k, v, table, 45, 0.3, causal_offset, blocks=TILES)
    ref_out, ref_lse = paged.paged_attention_forward_reference(q.double(), k.double(), v.double(), table, 45, 0.3,
                                                               causal_offset)
    torch.testing.assert_close(out.double(), ref_out, **F32_TOL)
    torch.testing.assert_close(lse.double(), ref_lse, **F32_TOL)  # -inf rows must match as -inf
    if causal_offset < 0:
        assert torch.isneginf(lse[:, :-causal_offset]).all() and (out[:, :-causal_offset] == 0).all()
    (dq, dk, dv), (ref_dq, ref_dk, ref_dv), _ = _grads_both(q, k, v, table, 45, 0.3, causal_offset, gen, dlse=True)
    assert torch.isfinite(dq).all()
    torch.testing.assert_close(dq.double(), ref_dq, **F32_TOL)
    torch.testing.assert_close(dk[table.long()].double(), ref_dk[table.long()], **F32_TOL)
    torch.testing.assert_close(dv[table.long()].double(), ref_dv[table.long()], **F32_TOL)


@kernels_run
def test_no_keys_at_all():
    gen, q, k, v, _ = _case(3, 4, 2, 21, 16)
    empty = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    out, lse = paged.paged_attention_forward_triton(q, k, v, empty, 0, 0.3, blocks=TILES)
    assert (out == 0).all() and torch.isneginf(lse).all()
    ref_out, ref_lse = paged.paged_attention_forward_reference(q.double(), k.double(), v.double(), empty, 0, 0.3)
    assert (ref_out == 0).all() and torch.isneginf(ref_lse).all()


@kernels_run
def test_dlse_enters_through_delta():
    """delta = rowsum(dout * out) - dlse: the lse gradient changes dq and dK (not dV)."""
    gen, q, k, v, table = _case(5, 4, 2, 37, 70)
    (dq, dk, dv), (ref_dq, ref_dk, ref_dv), _ = _grads_both(q, k, v, table, 70, 0.3, None, gen, dlse=True)
    torch.testing.assert_close(dq.double(), ref_dq, **F32_TOL)
    torch.testing.assert_close(dk[table.long()].double(), ref_dk[table.long()], **F32_TOL)
    torch.testing.assert_close(dv[table.long()].double(), ref_dv[table.long()], **F32_TOL)


@kernels_run
def test_gradient_pages_outside_the_table_are_untouched():
    """dK/dV are added to the gradient pages the (second) table names, on top of what they held; the others keep
    their bytes exactly."""
    gen, q, k, v, table = _case(9, 4, 2, 37, 40)  # 3 pages, the last partial
    grad_table = torch.tensor([8, 2, 5], dtype=torch.int32, device=DEVICE)
    (dq, dk, dv), (ref_dq, ref_dk, ref_dv), start = _grads_both(q, k, v, table, 40, 0.3, None, gen,
                                                                grad_table=grad_table, grad_pages=10)
    named = grad_table.long()
    others = torch.ones(10, dtype=torch.bool, device=DEVICE)
    others[named] = False
    assert torch.equal(dk[others], start[others]) and torch.equal(dv[others], start[others])
    # rows past the last key on the last page are not gradient rows either
    assert torch.equal(dk[5, 40 % PAGE:], start[5, 40 % PAGE:]) and torch.equal(dv[5, 40 % PAGE:], start[5, 40 % PAGE:])
    torch.testing.assert_close(dk[named].double(), ref_dk[named], **F32_TOL)
    torch.testing.assert_close(dv[named].double(), ref_dv[named], **F32_TOL)
    torch.testing.assert_close(dq.double(), ref_dq, **F32_TOL)


@kernels_run
def test_strided_pages_and_default_tiles():
    """Pages stored head-major [N, K, P, D] and read through a permuted view; the head dim's own tiles (64)."""
    gen = torch.Generator().manual_seed(21)
    table = torch.tensor([3, 0, 2], dtype=torch.int32, device=DEVICE)
    k = torch.randn(4, 2, PAGE, D, generator=gen).to(DEVICE).permute(0, 2, 1, 3)
    v = torch.randn(4, 2, PAGE, D, generator=gen).to(DEVICE).permute(0, 2, 1, 3)
    q = torch.randn(6, 19, D, generator=gen).to(DEVICE)
    out, lse = paged.paged_attention_forward_triton(q, k, v, table, 41, 0.25)
    ref_out, ref_lse = paged.paged_attention_forward_reference(q.double(), k.double(), v.double(), table, 41, 0.25)
    torch.testing.assert_close(out.double(), ref_out, **F32_TOL)
    torch.testing.assert_close(lse.double(), ref_lse, **F32_TOL)


@kernels_run
def test_autograd_function_on_both_paths(monkeypatch):
    """paged_partial_attention == plain autograd through the gather, on the reference path (CPU: the dispatch
    says so) and on the Triton path (the dispatch decision patched; the kernels run under the interpreter)."""
    gen, q, k, v, table = _case(13, 4, 2, 23, 50)
    scale = 0.3
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    ref_out, ref_lse = partial_attention_reference(q64, paged.gather_pages(k64, table, 50),
                                                   paged.gather_pages(v64, table, 50), scale)
    dout = torch.randn(ref_out.shape, generator=gen, dtype=torch.float64).to(DEVICE)
    dlse = torch.randn(ref_lse.shape, generator=gen, dtype=torch.float64).to(DEVICE)
    ref_q, ref_k, ref_v = torch.autograd.grad((ref_out * dout).sum() + (ref_lse * dlse).sum(), (q64, k64, v64))
    named = table.long()
    assert not paged.uses_triton(q.cpu())  # CPU tensors never reach Triton through the dispatch
    monkeypatch.setattr(paged, "_tiles", lambda d, blocks, kind: (16, 16, 4, 1))
    for triton_path in (False, True):
        monkeypatch.setattr(paged, "uses_triton", lambda q_HTD, on=triton_path: on)
        q32 = q.clone().requires_grad_()
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        out, lse = paged.paged_partial_attention(q32, k, v, table, 50, scale, grad_pages=(dk, dv))
        torch.testing.assert_close(out.double(), ref_out.detach(), **F32_TOL)
        torch.testing.assert_close(lse.double(), ref_lse.detach(), **F32_TOL)
        (dq,) = torch.autograd.grad((out * dout.float()).sum() + (lse * dlse.float()).sum(), (q32,))
        torch.testing.assert_close(dq.double(), ref_q, **F32_TOL)
        torch.testing.assert_close(dk[named].double(), ref_k[named], **F32_TOL)
        torch.testing.assert_close(dv[named].double(), ref_v[named], **F32_TOL)
        # without gradient pages, pages that require grad get a page-shaped autograd gradient
        kg, vg = k.clone().requires_grad_(), v.clone().requires_grad_()
        out, lse = paged.paged_partial_attention(q, kg, vg, table, 50, scale)
        gk, gv = torch.autograd.grad((out * dout.float()).sum() + (lse * dlse.float()).sum(), (kg, vg))
        torch.testing.assert_close(gk[named].double(), ref_k[named], **F32_TOL)
        torch.testing.assert_close(gv[named].double(), ref_v[named], **F32_TOL)


def test_inputs_checked_at_the_door():
    q = torch.randn(3, 4, D)
    k = torch.randn(2, PAGE, 2, D)
    table = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="do not fit"):
        paged.paged_partial_attention(q, k, k, table, 20, 0.3)
    with pytest.raises(ValueError, match="tokens=33"):
        paged.paged_partial_attention(torch.randn(4, 4, D), k, k, table, 33, 0.3)
    with pytest.raises(ValueError, match="page table"):
        paged.paged_partial_attention(torch.randn(4, 4, D), k, k, table.float(), 20, 0.3)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("d,page", [(64, 16), (256, 64)], ids=["d64-p16", "d256-p64"])
def test_compiled_kernels_on_cuda(dtype, d, page):
    """The compiled kernels through the public function (dispatch mode auto) against float64; the error may be at
    most 2x (plus a small floor) that of the same-precision torch reference on the same inputs (STYLE.md 3)."""
    assert dispatch.current_mode() == "auto"
    gen = torch.Generator(device="cuda").manual_seed(0)
    heads, kv_heads, tq, tokens = 8, 2, 333, 1000
    pages = -(-tokens // page) + 3
    table = torch.randperm(pages, generator=gen, device="cuda")[:-(-tokens // page)].to(torch.int32)
    k = torch.randn(pages, page, kv_heads, d, generator=gen, device="cuda").to(dtype)
    v = torch.randn(pages, page, kv_heads, d, generator=gen, device="cuda").to(dtype)
    q = torch.randn(heads, tq, d, generator=gen, device="cuda").to(dtype).requires_grad_()
    dout = torch.randn(heads, tq, d, generator=gen, device="cuda")
    dlse = torch.randn(heads, tq, generator=gen, device="cuda")
    scale = d ** -0.5
    assert paged.uses_triton(q)

    def run(q_, k_, v_, fn):
        out, lse, dq, dk, dv = fn(q_, k_, v_)
        return out.double(), lse.double(), dq.double(), dk.double(), dv.double()

    def objective(out, lse):
        return (out.float() * dout).sum() + (lse.float() * dlse).sum()

    def public(q_, k_, v_):  # the Triton kernels, gradient pages in float32
        dk, dv = (torch.zeros(k_.shape, dtype=torch.float32, device="cuda") for _ in range(2))
        out, lse = paged.paged_partial_attention(q_, k_, v_, table, tokens, scale, grad_pages=(dk, dv))
        (dq,) = torch.autograd.grad(objective(out, lse), (q_,))
        return out, lse, dq, dk, dv

    def plain(q_, k_, v_):  # gather + dense attention with autograd, in the inputs' precision
        q_ = q_.detach().clone().requires_grad_()
        k_, v_ = k_.clone().requires_grad_(), v_.clone().requires_grad_()
        out, lse = partial_attention_reference(q_, paged.gather_pages(k_, table, tokens),
                                               paged.gather_pages(v_, table, tokens), scale)
        dq, dk, dv = torch.autograd.grad(objective(out, lse), (q_, k_, v_))
        return out, lse, dq, dk, dv

    exact = run(q.detach().double(), k.double(), v.double(), plain)
    fast = run(q, k, v, public)
    same_precision = run(q, k, v, plain)
    named = table.long()
    for name, f, p, e in zip(("out", "lse", "dq", "dk", "dv"), fast, same_precision, exact, strict=True):
        if name in ("dk", "dv"):
            f, p, e = f[named], p[named], e[named]
        assert torch.isfinite(f).all(), name
        fast_err, plain_err = (f - e).abs().max().item(), (p - e).abs().max().item()
        assert fast_err <= 2 * plain_err + 1e-5, f"{name}: {fast_err} vs plain {plain_err}"


def _attention_with_past_case(gen, device="cpu", dtype=torch.float32):
    """A block of 21 queries over two past segments (a prompt segment read through strided token-major views,
    with a sink; an earlier block with autograd) plus itself (causal)."""
    heads, kv_heads, d = 4, 2, D

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)

    q = randn(heads, 21, d)
    prompt_k, prompt_v = randn(45, kv_heads, d), randn(45, kv_heads, d)  # token-major, as the pages store them
    earlier_k, earlier_v = randn(kv_heads, 19, d), randn(kv_heads, 19, d)
    new_k, new_v = randn(kv_heads, 21, d), randn(kv_heads, 21, d)
    dout, dlse = randn(heads, 21, d), randn(heads, 21)
    return q, (prompt_k, prompt_v), (earlier_k, earlier_v), (new_k, new_v), dout, dlse


def _run_attention_with_past(q, prompt, earlier, new, dout, dlse, key_block=16):
    """(out, lse, dq, d earlier k, d earlier v, d new k, d new v, prompt dk, prompt dv) through attention_with_past,
    the prompt's gradient collected by its sink block by block (as StagedPast's PagesPair does)."""
    from ds_longstraw.kernels import attention_with_past

    q = q.clone().requires_grad_()
    earlier = [x.clone().requires_grad_() for x in earlier]
    new = [x.clone().requires_grad_() for x in new]
    prompt_dk, prompt_dv = torch.zeros_like(prompt[0]), torch.zeros_like(prompt[1])

    def sink(offset, dk_KTD, dv_KTD):
        prompt_dk[offset:offset + dk_KTD.shape[1]] += dk_KTD.transpose(0, 1)
        prompt_dv[offset:offset + dv_KTD.shape[1]] += dv_KTD.transpose(0, 1)

    past = [(prompt[0].transpose(0, 1), prompt[1].transpose(0, 1)), tuple(earlier)]
    out, lse = attention_with_past(q, past, *new, 0.3, key_block=key_block, sinks=[sink, None])
    grads = torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), (q, *earlier, *new))
    return (out, lse, *grads, prompt_dk, prompt_dv)


@kernels_run
def test_attention_with_past_through_the_triton_kernels(monkeypatch):
    """kernels/attention/partial.py's CUDA route where flash does not apply: every key set (the prompt's with its
    sink, an earlier block's, the block's own causal one) through segment_forward / segment_backward (the dispatch
    decision patched; interpreter) == the CPU torch path on the same float32 inputs == float64."""
    from ds_longstraw.kernels.attention import partial as attention

    gen = torch.Generator().manual_seed(17)
    case = _attention_with_past_case(gen, device=DEVICE)
    exact = _run_attention_with_past(*[x.double() if torch.is_tensor(x) else tuple(t.double() for t in x)
                                       for x in case])
    with dispatch.kernel_mode("reference"):
        torch_path = _run_attention_with_past(*case)
    calls = []
    real = paged.segment_forward
    monkeypatch.setattr(paged, "segment_forward", lambda *a: calls.append(a[1].shape) or real(*a))
    monkeypatch.setattr(paged, "_tiles", lambda d, blocks, kind: (16, 16, 4, 1))
    monkeypatch.setattr(attention, "_triton_paged", lambda q_HTD, k_KTD: paged)
    triton_path = _run_attention_with_past(*case)
    assert len(calls) == 3  # prompt, earlier block, the block itself
    names = ("out", "lse", "dq", "dk earlier", "dv earlier", "dk new", "dv new", "dk prompt", "dv prompt")
    for name, t, c, e in zip(names, triton_path, torch_path, exact, strict=True):
        torch.testing.assert_close(t.double(), e, **F32_TOL, msg=name)
        torch.testing.assert_close(c.double(), e, **F32_TOL, msg=name)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_attention_with_past_float32_on_cuda_takes_triton(monkeypatch):
    """float32 on CUDA (flash takes bf16/fp16 only): attention_with_past runs the compiled Triton kernels, and
    matches float64 within float32 accumulation."""
    gen = torch.Generator().manual_seed(23)
    case = _attention_with_past_case(gen, device="cuda")
    calls = []
    real = paged.segment_forward
    monkeypatch.setattr(paged, "segment_forward", lambda *a: calls.append(1) or real(*a))
    fast = _run_attention_with_past(*case, key_block=2048)
    assert len(calls) == 3
    exact_case = [x.double() if torch.is_tensor(x) else tuple(t.double() for t in x) for x in case]
    exact = _run_attention_with_past(*exact_case, key_block=2048)  # float64: no Triton, no flash
    for t, e in zip(fast, exact, strict=True):
        torch.testing.assert_close(t.double(), e, **F32_TOL)
