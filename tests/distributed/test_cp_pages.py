"""A context-parallel rank's own pages, read from its tier page by page (the stager's stream), and what exact mode
injects under a caller's reduction.

Equivalence chains (float64):
  streamed_partial over a layer's pages, page by page   == partial_attention_reference over the whole layer
  streamed_grads (merged lse and delta)                 == autograd through that reference (dq, dK, dV)
  and the reads behind them: page-aligned pieces, never more than two staged at once, the next piece (and after a
  layer's last page, the next layer's first page) issued before the piece in hand is used.
  topology._scale_injected_ scales the gradient pages of streams that carry a gradient and allocates none for a
  kept-attention stream sharing the pool.
Tolerance 1e-12 (float64: the streamed forms only re-associate sums of a few terms).
"""

import pytest
import torch

from ds_longstraw.arch.specs import LayerState, Stream
from ds_longstraw.grpo.cp.kinds.attention.ring import layer_stager, streamed_grads, streamed_partial
from ds_longstraw.grpo.state import PrefixState
from ds_longstraw.grpo.topology import _scale_injected_
from ds_longstraw.kernels import partial_attention_reference
from ds_longstraw.kernels.attention import attention_delta
from ds_longstraw.offload import HostPagePool, PagePool

KV, D, H = 2, 8, 4
SPECS = [LayerState(0, "attention", "kv", streams=(Stream("k", (KV, D), torch.float64),
                                                   Stream("v", (KV, D), torch.float64)), combine="lse"),
         LayerState(1, "recurrent", "carry", combine="affine_scan"),
         LayerState(2, "attention", "kv", streams=(Stream("k", (KV, D), torch.float64),
                                                   Stream("v", (KV, D), torch.float64)), combine="lse")]


class RecordingPool(HostPagePool):
    """The host tier, recording every read it is asked for and how many are outstanding."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.requests, self.outstanding, self.peak_outstanding = [], 0, 0

    def begin_read(self, layer, name, start=0, end=None, kind="state"):
        ticket = super().begin_read(layer, name, start, end, kind)
        self.requests.append((layer, name, start, end))
        self.outstanding += 1
        self.peak_outstanding = max(self.peak_outstanding, self.outstanding)
        release = ticket.release

        def counted_release():
            if ticket.state.name != "RELEASED":
                self.outstanding -= 1
            release()

        ticket.release = counted_release
        return ticket


def _filled_pool(pool_class, tokens, page):
    gen = torch.Generator().manual_seed(0)
    pool = pool_class(page)
    for spec in SPECS:
        for stream in spec.streams:
            pool.reserve(spec.layer, stream.name, tokens, stream.shape, stream.dtype)
            pool.append(spec.layer, stream.name, torch.randn((tokens, KV, D), generator=gen, dtype=torch.float64))
    pool.flush()
    return pool


@pytest.mark.parametrize("tokens,page", [(10, 3), (7, 7), (1, 4)], ids=["ragged", "one-page", "one-token"])
def test_stream_reads_page_by_page_one_ahead(tokens, page):
    pool = _filled_pool(RecordingPool, tokens, page)
    stager = layer_stager(pool, SPECS)
    pieces = []
    for layer in (0, 2):
        for lo, hi, staged in stager.stream(layer):
            pieces.append((layer, lo, hi))
            assert staged["k"].shape[0] == hi - lo <= page
            # the next piece was issued before this one was handed out: this layer's next page, or the next
            # layer's first
            issued = {(layer_, start) for layer_, _, start, _ in pool.requests}
            following = (layer, hi) if hi < tokens else ((2, 0) if layer == 0 else None)
            assert following is None or following in issued
    stager.close()
    expected = [(layer, lo, min(tokens, lo + page)) for layer in (0, 2) for lo in range(0, tokens, page)]
    assert pieces == expected
    assert all(end - start <= page for _, _, start, end in pool.requests)
    assert pool.peak_outstanding <= 2 * 2  # two pieces of two streams at most
    assert pool.outstanding == 0  # every read released
    pool.release()


@pytest.mark.parametrize("pool_class", [PagePool, RecordingPool], ids=["device", "host"])
@pytest.mark.parametrize("start,end", [(0, None), (4, 9), (5, 5)], ids=["all", "middle", "empty"])
def test_streamed_attention_equals_the_whole_layer(pool_class, start, end):
    tokens, page, scale = 10, 3, 0.3
    pool = _filled_pool(pool_class, tokens, page)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn((H, 5, D), generator=gen, dtype=torch.float64)
    stop = tokens if end is None else end
    k = pool.read(0, "k", start, stop).transpose(0, 1).clone().requires_grad_(True)
    v = pool.read(0, "v", start, stop).transpose(0, 1).clone().requires_grad_(True)
    q_ref = q.clone().requires_grad_(True)
    out_ref, lse_ref = partial_attention_reference(q_ref, k, v, scale)
    stager = layer_stager(pool, SPECS)
    out, lse = streamed_partial(stager, SPECS[0], q, scale, start, end)
    if stop == start:
        assert torch.all(out == 0) and torch.all(lse == float("-inf"))
        return
    torch.testing.assert_close(out, out_ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse_ref.detach(), rtol=1e-12, atol=1e-12)
    if start != 0 or end is not None:
        return  # streamed_grads covers a whole layer (what replay and the prefix pass's servers need)
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    dlse = torch.randn(lse.shape, generator=gen, dtype=torch.float64)
    torch.autograd.backward([out_ref, lse_ref], [dout, dlse])
    dq = streamed_grads(stager, SPECS[0], q, lse, dout, attention_delta(out, dout, dlse), scale, pool)
    stager.close()
    torch.testing.assert_close(dq, q_ref.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(pool.read_grad(0, "k").transpose(0, 1), k.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(pool.read_grad(0, "v").transpose(0, 1), v.grad, rtol=1e-12, atol=1e-12)
    assert pool.read_grad(2, "k").abs().sum() == 0  # the other layer's pages got nothing


def test_scale_injected_touches_only_streams_with_a_gradient():
    """Kept attention ("o", "lse") shares the K/V pool when it has no tier of its own: scaling the injected
    gradients must not create gradient pages for it."""
    spec = LayerState(0, "attention", "kv", streams=(Stream("k", (KV, D), torch.float64),
                                                     Stream("v", (KV, D), torch.float64)), combine="lse",
                      kept=(Stream("o", (H, D), torch.float64, grad=False),
                            Stream("lse", (H,), torch.float64, grad=False)))
    pool = PagePool(4)
    for stream in spec.streams + spec.kept:
        pool.reserve(0, stream.name, 6, stream.shape, stream.dtype)
        pool.append(0, stream.name, torch.ones((6, *stream.shape), dtype=torch.float64))
    for name in ("k", "v"):
        pool.add_grad(0, name, 0, torch.full((6, KV, D), 0.5, dtype=torch.float64))
    state = PrefixState(length=6, pool=pool, specs=[spec])
    d_final = {1: (torch.ones(2), torch.full((3,), 2.0))}
    before = pool.grad_bytes()
    _scale_injected_(state, d_final, 3)
    assert pool.grad_bytes() == before  # no gradient pages for "o" and "lse"
    assert torch.all(pool.read_grad(0, "k") == 1.5) and torch.all(pool.read_grad(0, "v") == 1.5)
    assert torch.equal(d_final[1][0], torch.full((2,), 3.0)) and torch.equal(d_final[1][1], torch.full((3,), 6.0))


def test_context_parallelism_refuses_a_combine_it_does_not_run():
    """A layer whose combine the CP schedule does not run is refused at the door, naming the key, the layers and the
    combine, not half-way through a capture; qwen3_5's and GLM-5.2's combines pass. Every combine specs.py declares
    runs under CP today, so the refused one is written past LayerState's own check (a spec from a newer family)."""
    from models import tiny_qwen3_5_config
    from transformers import GlmMoeDsaConfig

    from ds_longstraw.arch import specs_for_config
    from ds_longstraw.grpo.topology import check_combines

    check_combines(specs_for_config(tiny_qwen3_5_config(), torch.float64), 2)
    glm = specs_for_config(GlmMoeDsaConfig(num_hidden_layers=2, indexer_types=["full", "shared"]), torch.float64)
    check_combines(glm, 2)
    unknown = LayerState(1, "future", "future_pages", combine="none")
    object.__setattr__(unknown, "combine", "ring_of_experts")  # frozen dataclass: past __post_init__'s check
    with pytest.raises(ValueError, match=r"'longstraw.cp_size' = 2: layers \[1\] combine across ranks by "
                                         r"\['ring_of_experts'\]"):
        check_combines([glm[0], unknown], 2)
