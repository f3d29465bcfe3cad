"""grpo_backward with the retained state on the host or on NVMe gives the gradients of tier "none".

Equivalence chain (float64 tiny qwen3_5, float64_model()):
  grpo_backward(tier=cpu | nvme (aio) | nvme (buffered I/O), mode) == grpo_backward(tier=none, mode)
for mode in detached, exact and exact with kept attention pages (with the other pages, or alone on NVMe), and
test_transaction.py ties tier none to independent references.
Tolerance: relative L2 <= 1e-12 over all parameter gradients (and log-probs within 1e-12). Every tier runs the
same float64 operations in the same order on the same values (pages are moved bit for bit), so the difference
is 0 in practice; 1e-12 leaves room for nothing but a reordering, which a wrong page would exceed by far.
Also: page files are gone after success and after an error half-way through the transaction.
"""

import pytest
import torch
from grads import grads_of, relative_l2
from models import float64_model, tiny_qwen3_5

from ds_longstraw import GRPOGroup, GRPOObjective, grpo_backward
from ds_longstraw.offload import io_engine

TOL = 1e-12
SETTINGS = {"capture_chunk": 5, "page_tokens": 3, "replay_block": 2}


def _group():
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 97, (17,), generator=gen)
    responses = [torch.randint(0, 97, (n,), generator=gen) for n in (3, 5)]
    return GRPOGroup(prompt, responses, rewards=[0.2, 0.9])


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3_5()


_REFERENCE = {}


def _run(model, mode, offload, objective=None):
    # "exact-keep": exact mode with the attention outputs kept on pages of the same tier (prefix_keep_attention);
    # exact mode otherwise keeps no capture graph, so that its prefix pass walks every segment from the tiers' pages,
    # except "exact-graph": the capture's graph kept where it fits (prefix_keep_graph "fits", asked for)
    config = {"prefix_grad": mode.split("-")[0], "prefix_keep_attention": mode.endswith("-keep"), **SETTINGS,
              "prefix_keep_graph": "fits" if mode.endswith("-graph") else False, "offload": offload}
    with float64_model():
        return grads_of(model, lambda: grpo_backward(model, _group(), objective, longstraw=config))


def _reference(model, mode):
    if mode not in _REFERENCE:
        _REFERENCE[mode] = _run(model, mode, {"tier": "none"})
    return _REFERENCE[mode]


def _offload(tier, path, monkeypatch, depth=1):
    if tier == "cpu":
        return {"tier": "cpu", "staging_depth": depth}
    if tier == "kept-on-nvme":  # K/V and gradient pages on the device, kept attention outputs in files
        return {**_offload("nvme-aio", path, monkeypatch, depth), "tier": "none", "kept_attention_tier": "nvme"}
    if tier == "nvme-aio":
        try:
            io_engine.load_aio()
        except RuntimeError as error:
            pytest.skip(f"DeepSpeed's aio op cannot be built here: {error}")
    else:  # as on a filesystem that refuses O_DIRECT
        monkeypatch.setattr("ds_longstraw.offload.nvme_pool.probe_direct_io", lambda directory: False)
    return {"tier": "nvme", "nvme_path": str(path), "staging_depth": depth,
            "aio": {"block_size": 4096, "queue_depth": 4}}


# Each run costs seconds on 2 cores: every tier in exact mode (the mode that also reads and writes gradient pages),
# the host and aio tiers in detached mode.
CASES = [("detached", "cpu", 1), ("detached", "nvme-aio", 1),
         ("exact", "cpu", 1), ("exact", "nvme-aio", 2), ("exact", "nvme-buffered", 1), ("exact-keep", "nvme-aio", 1),
         ("exact-keep", "kept-on-nvme", 1), ("exact-graph", "cpu", 1), ("exact-graph", "nvme-aio", 1)]


@pytest.mark.parametrize("mode,tier,depth", CASES)
def test_tiers_match_tier_none(model, mode, tier, depth, tmp_path, monkeypatch):
    ref_grads, ref = _reference(model, mode)
    grads, result = _run(model, mode, _offload(tier, tmp_path, monkeypatch, depth))
    assert relative_l2(grads, ref_grads) <= TOL
    assert result.loss == pytest.approx(ref.loss, rel=TOL, abs=TOL)
    for mine, theirs in zip(result.logprobs, ref.logprobs, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=TOL)
    assert result.retained_bytes == ref.retained_bytes
    assert result.grad_page_bytes == ref.grad_page_bytes
    assert list(tmp_path.iterdir()) == []  # page files removed on success


class _FailingObjective(GRPOObjective):
    def member_loss(self, group, member, *args, **kwargs):
        if member == 1:
            raise RuntimeError("member 1 failed")
        return super().member_loss(group, member, *args, **kwargs)


@pytest.mark.parametrize("mode,tier", [("exact", "nvme-aio"), ("exact-keep", "kept-on-nvme")])
def test_page_files_removed_on_error(model, tmp_path, monkeypatch, mode, tier):
    with pytest.raises(RuntimeError, match="member 1 failed"):
        _run(model, mode, _offload(tier, tmp_path, monkeypatch), _FailingObjective())
    assert list(tmp_path.iterdir()) == []


def test_prefix_pass_error_leaves_no_read_in_flight(model, tmp_path, monkeypatch):
    """An error in the exact prefix pass while the next segment's kept attention is being read ahead from NVMe:
    the read is completed and dropped, and the page files go (the pool is released with nothing in flight)."""
    calls = []

    def backward(scalar):  # the 2 members' losses, then one surrogate per prefix-pass segment
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("segment 2 failed")
        scalar.backward()

    config = {"prefix_grad": "exact", "prefix_keep_attention": True, "prefix_keep_graph": False, **SETTINGS,
              "offload": _offload("kept-on-nvme", tmp_path, monkeypatch)}
    with float64_model(), pytest.raises(RuntimeError, match="segment 2 failed"):
        grpo_backward(model, _group(), GRPOObjective(), longstraw=config, backward=backward)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("tier", ["cpu", "nvme-aio"])
def test_graph_holds_no_staged_pages(tier, tmp_path, monkeypatch):
    """A model with 4 attention layers, staging depth 1: at every moment of the transaction (capture, each
    member's forward and backward, the exact prefix pass) at most the stager's window of staged copies, k and v of
    2 layers, is alive; without the saved-tensor handles a member's graph would keep all 4 layers."""
    from ds_longstraw.offload import Stager

    types = ["linear_attention", "full_attention", "full_attention", "linear_attention", "full_attention",
             "full_attention"]
    wide = tiny_qwen3_5(layers=6, layer_types=types)
    alive = []
    get = Stager.get

    def counting_get(self, *args):
        staged = get(self, *args)
        alive.append(sum(ref() is not None for ref, _, _ in self._owned.values()))
        return staged

    ref_grads, _ = _run(wide, "exact", {"tier": "none"})
    monkeypatch.setattr(Stager, "get", counting_get)
    grads, _ = _run(wide, "exact", _offload(tier, tmp_path, monkeypatch))
    assert relative_l2(grads, ref_grads) <= TOL
    assert alive and max(alive) <= 2 * 2
    assert list(tmp_path.iterdir()) == []


def test_missing_nvme_path_is_a_config_error(model, tmp_path):
    with pytest.raises(ValueError, match="offload.nvme_path"):
        _run(model, "detached", {"tier": "nvme", "nvme_path": str(tmp_path / "absent")})


@pytest.mark.parametrize("tier", ["cpu", "nvme-aio"])
def test_gdn_checkpoints_live_on_the_pages_tier(model, tier, tmp_path, monkeypatch):
    """Exact mode's GDN carry checkpoints go to the pages' tier, one checkpoint a page, instead of the device: each
    segment's carry read back equals the device store's bit for bit, the bytes reported are the same, and the
    store's files go with the state."""
    from ds_longstraw.arch import adapter_for
    from ds_longstraw.config import parse_config
    from ds_longstraw.grpo.state import CarryCheckpoints, PooledCarryCheckpoints, capture_prefix

    adapter = adapter_for(model)
    prompt = _group().prompt_ids

    def capture(offload):
        longstraw = parse_config({"prefix_grad": "exact", **SETTINGS, "offload": offload})
        with float64_model(), torch.no_grad():
            return capture_prefix(adapter, prompt, longstraw, "exact")

    on_device = capture({"tier": "none"})
    on_tier = capture(_offload(tier, tmp_path, monkeypatch))
    try:
        assert isinstance(on_device.checkpoints, CarryCheckpoints)
        assert isinstance(on_tier.checkpoints, PooledCarryCheckpoints)
        expected_bytes = on_device.retained_bytes()["carry_checkpoints"]
        assert on_tier.retained_bytes()["carry_checkpoints"] == expected_bytes > 0
        assert len(on_tier.boundaries) == len(on_device.boundaries) == 4  # 16 captured tokens, segments of 5
        for mine, theirs in zip(on_tier.boundaries, on_device.boundaries, strict=True):
            loaded, expected = on_tier.begin_carry(mine).result(), on_device.begin_carry(theirs).result()
            assert loaded.keys() == expected.keys()
            for layer, (state, tail) in expected.items():
                assert torch.equal(loaded[layer][0], state) and torch.equal(loaded[layer][1], tail)
    finally:
        on_tier.release()
        on_device.release()
    assert list(tmp_path.iterdir()) == []
