"""The CUDA fast paths (kernels/attention/flash.py, kernels/gated_delta/fla_bridge.py) and how they are chosen.

On CPU (CI): the dispatch never hands CPU tensors to a CUDA path, the "kernels" key forces the reference, and the
lse-gradient fold that lets flash's backward serve a merged attention is exact (proved with torch's fused CPU flash
backward, which, like the CUDA one, reads `out` only through rowsum(dout * out)).
On a CUDA device (marked `cuda`; bench/gpu_check.sh runs them): torch's flash kernels and fla's gated delta rule
against the project's float64 references.
"""

import pytest
import torch

from ds_longstraw.config import parse_config
from ds_longstraw.kernels import chunk_gated_delta_rule, partial_attention, partial_attention_reference
from ds_longstraw.kernels.attention import partial as attention
from ds_longstraw.kernels.attention.flash import flash_applies, fold_lse_grad
from ds_longstraw.kernels.dispatch import current_mode, fast_path, kernel_mode, use_attention_library
from ds_longstraw.kernels.gated_delta import recurrent_gated_delta_rule
from ds_longstraw.kernels.gated_delta.fla_dqkwg import dqkwg_refused, refused_by_fla

F64 = dict(dtype=torch.float64)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cpu_tensors_never_take_a_cuda_path():
    x = torch.zeros(2, 3, 8, dtype=torch.bfloat16)
    assert not fast_path(x) and not fast_path(x, "torch")
    assert not flash_applies(x, x, None)


def test_kernel_mode_is_restored_after_an_error():
    assert current_mode() == "auto"
    with pytest.raises(RuntimeError), kernel_mode("reference"):
        assert current_mode() == "reference"
        raise RuntimeError("inside")
    assert current_mode() == "auto"
    with pytest.raises(ValueError, match="fastest"):
        with kernel_mode("fastest"):
            pass


@pytest.mark.parametrize("major,version,refused", [
    (9, "3.6.0", True), (9, "3.4.0", True), (9, "3.7.0+git1a2b", True), (9, "3.7.1rc1", True),  # rc reads as 3.7
    (9, "3.7.1", False), (9, "3.9.0", False), (9, "3.3.1", False), (8, "3.6.0", False), (10, "3.6.0", False)])
def test_fla_refuses_its_dqkwg_step_on_hopper_with_triton_3_4_to_3_7_1(major, version, refused):
    """Where fla's Triton `chunk_bwd_dqkwg` is refused, and so the project's torch step is taken (fla_dqkwg.py; the
    step itself is proven against fla's kernel under the Triton interpreter, tests/unit/test_fla_interpreter.py)."""
    assert refused_by_fla(major, version) is refused


def test_cpu_tensors_never_ask_for_the_torch_dqkwg_step():
    assert not dqkwg_refused(torch.device("cpu"))


def test_every_dispatch_records_the_path_it_took(monkeypatch):
    """A fast path never replaces its reference silently: each kernel call records its path (kernels/dispatch.py),
    and the launcher prints them after the first step (tests/launcher/test_launcher.py)."""
    from ds_longstraw.kernels import chunked_logprobs, dsa
    from ds_longstraw.kernels.dispatch import describe_paths, paths_taken, reset_paths_taken

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(heads, 6, 8, generator=gen, requires_grad=True) for heads in (4, 2, 2))
    reset_paths_taken()
    out, _ = partial_attention(q, k, v, 0.3)
    out.sum().backward()
    monkeypatch.setattr(attention, "USE_FUSED", False)
    out, _ = partial_attention(q, k, v, 0.3)
    out.sum().backward()
    x = torch.randn(1, 5, 2, 8, generator=gen)
    chunk_gated_delta_rule(x, x, torch.randn(1, 5, 4, 8, generator=gen), -torch.rand(1, 5, 4, generator=gen),
                           torch.rand(1, 5, 4, generator=gen))
    hidden, weight = torch.randn(3, 8, generator=gen), torch.randn(50, 8, generator=gen)
    chunked_logprobs(hidden, weight, torch.tensor([1, 20, 49]), None, 16)
    dsa.dsa_select(torch.randn(4, 2, 8, generator=gen), torch.ones(4, 2), [torch.randn(4, 8, generator=gen)], 0, 2,
                   1.0)
    assert paths_taken() == {
        "attention forward": {"torch_fused_cpu": 1, "torch_blockwise": 1},
        "attention backward": {"torch_fused_cpu": 1, "torch_blockwise": 1},
        "gated delta rule": {"torch_chunked": 1},
        "log-probs": {"chunked": 1},
        "DSA selection": {"torch": 1}}
    assert describe_paths() == (
        "kernels (mode auto): attention forward: torch_fused_cpu x 1, torch_blockwise x 1; attention backward: "
        "torch_fused_cpu x 1, torch_blockwise x 1; gated delta rule: torch_chunked x 1; log-probs: chunked x 1; "
        "DSA selection: torch x 1")
    reset_paths_taken()
    with kernel_mode("reference"):
        assert describe_paths() == "kernels (mode reference): none ran"


def test_kernels_key_is_validated_by_name():
    assert parse_config({"kernels": "reference"}).kernels == "reference"
    with pytest.raises(ValueError, match="'longstraw.kernels' = 'triton'"):
        parse_config({"kernels": "triton"})


def test_lse_gradient_fold_is_exact():
    gen = torch.Generator().manual_seed(0)
    out, dout = torch.randn(4, 9, 16, generator=gen, **F64), torch.randn(4, 9, 16, generator=gen, **F64)
    dlse = torch.randn(4, 9, generator=gen, **F64)
    folded = fold_lse_grad(out, dout, dlse)
    # the fold computes in float32 (as flash does on CUDA): 1e-5 relative to the rows' magnitudes
    torch.testing.assert_close((dout * folded).sum(-1), (dout * out).sum(-1) - dlse, rtol=1e-5, atol=1e-5)
    dout[1, 2] = 0
    assert fold_lse_grad(out, dout, dlse) is None  # dlse != 0 with dout = 0: no out' can carry it
    dlse[1, 2] = 0
    assert fold_lse_grad(out, dout, dlse) is not None
    # no lse gradient (None, or all zero): out itself, nothing to fold
    assert fold_lse_grad(out, dout, None) is out and fold_lse_grad(out, dout, torch.zeros_like(dlse)) is out


def test_folded_lse_gradient_through_a_flash_style_backward():
    """The fold, fed to torch's fused CPU flash backward (no lse gradient of its own), gives the merged-attention
    gradients that the blockwise path computes with dlse. float32 inputs (the fold's precision): 2e-4 absolute."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(s, generator=gen) for s in [(6, 21, 16), (2, 33, 16), (2, 33, 16)])
    out, lse = partial_attention_reference(q.double(), k.double(), v.double(), 0.25)
    out, lse = out.float(), lse.float()
    dout, dlse = torch.randn(out.shape, generator=gen), torch.randn(lse.shape, generator=gen)
    folded = fold_lse_grad(out, dout, dlse)
    fused = attention._fused_cpu_backward(q, k, v, folded, lse, dout, 0.25, None)
    blockwise = attention._blockwise_backward(q.double(), k.double(), v.double(), out.double(), lse.double(),
                                              dout.double(), dlse.double(), 0.25, None, 8, True)
    for got, want in zip(fused, blockwise, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-4)


# ---- on a CUDA device ------------------------------------------------------------------------------------------

def _attention_case(heads, kv_heads, tq, tk, d, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, **F64) for s in [(heads, tq, d), (kv_heads, tk, d), (kv_heads, tk, d)]]


def _library_against_float64(library, heads, kv_heads, tq, tk, causal, with_lse_grad):
    """bf16 `partial_attention` through `library` against the float64 dense reference: bf16 inputs and outputs
    carry ~4e-3 relative rounding, so values agree to 3e-2 absolute on unit-variance data and gradients (of out and,
    with_lse_grad, of the lse) to 6e-2."""
    q, k, v = _attention_case(heads, kv_heads, tq, tk, 64, seed=tq + tk)
    qb, kb, vb = (x.to("cuda", torch.bfloat16).requires_grad_() for x in (q, k, v))
    ref = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = partial_attention_reference(*ref, 0.125, causal)
    gen = torch.Generator().manual_seed(5)
    dout = torch.randn(ref_out.shape, generator=gen, **F64)
    dlse = torch.randn(ref_lse.shape, generator=gen, **F64) if with_lse_grad else torch.zeros(ref_lse.shape, **F64)
    seen = torch.isfinite(ref_lse)
    with use_attention_library(library):
        out, lse = partial_attention(qb, kb, vb, 0.125, causal)
        objective = (out.double() * dout.cuda()).sum() + (lse.double().masked_fill(~seen.cuda(), 0)
                                                          * dlse.cuda()).sum()
        grads = torch.autograd.grad(objective, [qb, kb, vb])
    torch.testing.assert_close(out.double().cpu(), ref_out, rtol=0, atol=3e-2)
    torch.testing.assert_close(lse.double().cpu(), ref_lse, rtol=0, atol=3e-2)
    ref_objective = (ref_out * dout).sum() + (ref_lse.masked_fill(~seen, 0) * dlse).sum()
    for got, want in zip(grads, torch.autograd.grad(ref_objective, ref), strict=True):
        torch.testing.assert_close(got.double().cpu(), want, rtol=0, atol=6e-2)


@CUDA
@pytest.mark.cuda
@pytest.mark.parametrize("heads,kv_heads,tq,tk,causal", [(8, 2, 64, 300, None), (4, 4, 77, 77, 0),
                                                         (8, 1, 40, 130, 90), (6, 2, 50, 20, -30)])
@pytest.mark.parametrize("with_lse_grad", [False, True])
def test_flash_partial_attention_matches_float64(heads, kv_heads, tq, tk, causal, with_lse_grad):
    """Flash (not the default library: forced here) at bf16 tolerances. The last case (causal offset Tk - Tq < 0)
    has rows that see no key: -inf lse, zero output."""
    causal = None if causal is None else tk - tq
    q = torch.zeros(heads, tq, 64, device="cuda", dtype=torch.bfloat16)
    assert flash_applies(q, torch.zeros(kv_heads, tk, 64, device="cuda", dtype=torch.bfloat16), causal)
    _library_against_float64("flash", heads, kv_heads, tq, tk, causal, with_lse_grad)


def test_attention_library_is_chosen_by_name_and_restored():
    from ds_longstraw.kernels.attention.cudnn import cudnn_applies
    from ds_longstraw.kernels.dispatch import attention_library

    assert attention_library() == "cudnn"  # the default: the faster on the H200 (BENCHMARKS.md)
    x = torch.zeros(4, 8, 64, dtype=torch.bfloat16)
    assert not cudnn_applies(x, x, None)  # CPU tensors never take a CUDA path
    with use_attention_library("flash"):
        assert attention_library() == "flash"
        assert not cudnn_applies(x, x, None)
    assert attention_library() == "cudnn"
    with pytest.raises(ValueError, match="attention library 'flash3'"):
        with use_attention_library("flash3"):
            pass
    assert attention_library() == "cudnn"


@CUDA
@pytest.mark.cuda
@pytest.mark.parametrize("heads,kv_heads,tq,tk,causal", [(8, 2, 64, 300, None), (4, 4, 77, 77, 0),
                                                         (24, 4, 96, 96, 0), (6, 2, 50, 20, -30), (8, 2, 1, 300, None)])
@pytest.mark.parametrize("with_lse_grad", [False, True])
def test_cudnn_partial_attention_matches_float64(heads, kv_heads, tq, tk, causal, with_lse_grad):
    """cuDNN (dispatch.attention_library "cudnn") against the float64 dense reference, at the bf16 tolerances of the
    flash test above: grouped and equal heads, unmasked and a causal block over its own keys (what cuDNN takes);
    a causal offset it does not express (rows with no key) and a decode step's one query go to flash and say so."""
    from ds_longstraw.kernels.attention.cudnn import MIN_QUERIES, cudnn_applies
    from ds_longstraw.kernels.dispatch import paths_taken, reset_paths_taken

    takes = causal in (None, 0) and tq >= MIN_QUERIES
    x = torch.zeros(heads, tq, 64, device="cuda", dtype=torch.bfloat16)
    with use_attention_library("cudnn"):
        assert cudnn_applies(x, torch.zeros(kv_heads, tk, 64, device="cuda", dtype=torch.bfloat16), causal) is takes
    reset_paths_taken()
    _library_against_float64("cudnn", heads, kv_heads, tq, tk, causal, with_lse_grad)
    expected = "cudnn" if takes else "flash"
    assert set(paths_taken()["attention forward"]) == {expected}
    assert set(paths_taken()["attention backward"]) == {expected}


@CUDA
@pytest.mark.cuda
@pytest.mark.parametrize("library", ["flash", "cudnn"])
def test_library_serves_prompt_pages_in_library_key_blocks(library):
    """A prompt segment longer than LIBRARY_KEY_BLOCK on a library path (flash, cuDNN): with a sink (exact mode) the
    gradient pages get dK/dV in LIBRARY_KEY_BLOCK-key calls, without one (detached mode) dq comes from calls of that
    length; both against the float64 reference (bf16 tolerance as above)."""
    from ds_longstraw.kernels import attention_with_past, attention_with_past_reference
    from ds_longstraw.kernels.attention import partial as attention

    tk = attention.LIBRARY_KEY_BLOCK * 2 + 300
    q, k, v = _attention_case(8, 2, 32, tk, 64, seed=11)
    k_new, v_new = _attention_case(8, 2, 32, 32, 64, seed=12)[1:]
    gen = torch.Generator().manual_seed(13)
    dout = torch.randn(8, 32, 64, generator=gen, **F64)
    ref = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out, _ = attention_with_past_reference(ref[0], [(ref[1], ref[2])], k_new, v_new, 0.125)
    ref_dq, ref_dk, ref_dv = torch.autograd.grad((ref_out * dout).sum(), ref)
    fast = [x.to("cuda", torch.bfloat16) for x in (q, k, v, k_new, v_new)]
    for with_sink in (True, False):
        qb = fast[0].clone().requires_grad_()
        received, lengths = [torch.zeros(2, tk, 64, **F64) for _ in range(2)], []

        def sink(offset, dk, dv, lengths=lengths, received=received):
            lengths.append(dk.shape[1])
            for into, grad in zip(received, (dk, dv), strict=True):
                into[:, offset:offset + grad.shape[1]] += grad.double().cpu()

        with use_attention_library(library):
            out, _ = attention_with_past(qb, [(fast[1], fast[2])], fast[3], fast[4], 0.125,
                                         sinks=[sink] if with_sink else None)
            (dq,) = torch.autograd.grad((out.double() * dout.cuda()).sum(), qb)
        torch.testing.assert_close(dq.double().cpu(), ref_dq, rtol=0, atol=6e-2)
        if with_sink:
            assert lengths == [attention.LIBRARY_KEY_BLOCK] * 2 + [300]
            torch.testing.assert_close(received[0], ref_dk, rtol=0, atol=6e-2)
            torch.testing.assert_close(received[1], ref_dv, rtol=0, atol=6e-2)


@CUDA
@pytest.mark.cuda
def test_reference_mode_keeps_cuda_tensors_on_the_torch_path():
    q, k, v = (x.to("cuda", torch.bfloat16) for x in _attention_case(4, 2, 16, 32, 64, seed=0))
    assert flash_applies(q, k, None)
    with kernel_mode("reference"):
        assert not flash_applies(q, k, None)


@CUDA
@pytest.mark.cuda
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-3), (torch.bfloat16, 6e-2)])
def test_fla_delta_rule_matches_the_token_loop(dtype, atol):
    """fla's chunk kernel (taken for CUDA tensors) against the float64 token loop: values, final state and every
    gradient, the initial state's included. fla computes in tf32/bf16 matmuls: 2e-3 (float32), 6e-2 (bf16).
    On Hopper with Triton >= 3.4 and < 3.7.1 the backward takes the project's torch dqkwg step (fla_dqkwg.py)."""
    pytest.importorskip("fla")
    from ds_longstraw.kernels.gated_delta.fla_bridge import fla_applies

    gen = torch.Generator().manual_seed(3)
    b, t, hk, hv, dk, dv = 1, 200, 2, 4, 64, 64
    q, k = (torch.randn(b, t, hk, dk, generator=gen, **F64) for _ in range(2))
    v = torch.randn(b, t, hv, dv, generator=gen, **F64)
    g = -torch.rand(b, t, hv, generator=gen, **F64) * 0.2
    beta = torch.rand(b, t, hv, generator=gen, **F64)
    h0 = torch.randn(b, hv, dk, dv, generator=gen, **F64) * 0.1
    inputs = [q, k, v, g, beta, h0]
    fast = [x.to("cuda", dtype if i < 5 else torch.float32).requires_grad_() for i, x in enumerate(inputs)]
    with torch.no_grad():  # capture's forward: fla on every CUDA device
        assert fla_applies(fast[0], fast[2], fast[5])
        out, final = chunk_gated_delta_rule(*fast[:5], initial_state=fast[5], output_final_state=True,
                                            use_qk_l2norm_in_kernel=True)
    ref = [x.clone().requires_grad_() for x in inputs]
    ref_out, ref_final = recurrent_gated_delta_rule(*ref[:5], initial_state=ref[5], output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out.double().cpu(), ref_out.detach(), rtol=0, atol=atol)
    torch.testing.assert_close(final.double().cpu(), ref_final.detach(), rtol=0, atol=atol)
    # with autograd: fla's backward, with the project's torch dqkwg step where fla refuses its own (fla_dqkwg.py)
    assert fla_applies(fast[0], fast[2], fast[5])
    out, final = chunk_gated_delta_rule(*fast[:5], initial_state=fast[5], output_final_state=True,
                                        use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out.double().cpu(), ref_out, rtol=0, atol=atol)
    torch.testing.assert_close(final.double().cpu(), ref_final, rtol=0, atol=atol)
    gen = torch.Generator().manual_seed(4)
    dout, dfinal = torch.randn(ref_out.shape, generator=gen, **F64), torch.randn(ref_final.shape, generator=gen, **F64)
    grads = torch.autograd.grad((out.double() * dout.cuda()).sum() + (final.double() * dfinal.cuda()).sum(), fast)
    ref_grads = torch.autograd.grad((ref_out * dout).sum() + (ref_final * dfinal).sum(), ref)
    for got, want in zip(grads, ref_grads, strict=True):
        scale = want.abs().max().clamp_min(1.0)
        torch.testing.assert_close(got.double().cpu() / scale, want / scale, rtol=0, atol=atol)
