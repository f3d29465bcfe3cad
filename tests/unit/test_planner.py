"""The tier planner's estimates against measured runs of small models, and against the published figures.

Equivalence chain:
  plan.retained_per_rank(shape of a tiny qwen3_5 config) == PrefixState.retained_bytes() of a real capture of that
  model (attention K/V pages, GDN state, exact mode's GDN checkpoints), byte for byte, for prompts that are not
  multiples of the chunk; the gradient pages == GroupResult.grad_page_bytes of a real exact run.
  Built-in shapes == mission/NUMBERS.md: 64 KiB per token and 17.2 GB per rank at 2M tokens on CP8 (Qwen3.6-27B);
  95,232 B per token and 5.82 GiB per rank on CP32 (GLM-5.2).
  Routed experts: the family's expert_shape == the parameters of a real tiny model's MoE blocks; GLM-5.2's expert
  figures (weights per rank with and without EP, ZeRO-3's gather per MoE call, all-to-all bytes) == hand arithmetic
  from its published shape. (The all-to-all formula against measured dispatch bytes: BENCHMARKS.md, bench_ep.py.)
"""

import dataclasses
import json

import pytest
import torch
from models import float64_model, tiny_qwen3_5, tiny_qwen3_5_config

from ds_longstraw import GRPOGroup, grpo_backward, parse_config
from ds_longstraw.arch import adapter_for
from ds_longstraw.grpo.state import capture_prefix
from ds_longstraw.models.model_shape import load_config, shape_from_config
from ds_longstraw.offload import plan as plan_module
from ds_longstraw.offload.plan import Cluster, GiB, make_plan, retained_per_rank, rollout_figures
from ds_longstraw.sizes import parse_bytes, parse_tokens
from ds_longstraw.tools.planner import main


def _tiny_shape(dtype, layers=4):
    config = tiny_qwen3_5_config(layers=layers).to_dict()
    return shape_from_config("tiny", config, torch.empty((), dtype=dtype).element_size())


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("prompt_len,chunk", [(2, 4), (23, 5), (40, 8)])
@pytest.mark.parametrize("mode", ["detached", "exact", "exact-keep"])
def test_retained_bytes_match_a_real_capture(dtype, prompt_len, chunk, mode):
    model = tiny_qwen3_5(dtype=dtype, layers=8)
    adapter = adapter_for(model)
    prefix_grad, keep = mode.removesuffix("-keep"), mode == "exact-keep"
    longstraw = parse_config({"capture_chunk": chunk, "page_tokens": 3, "prefix_grad": prefix_grad,
                              "prefix_keep_attention": keep})
    prompt = torch.randint(0, 97, (prompt_len,), generator=torch.Generator().manual_seed(0))
    with float64_model():
        state = capture_prefix(adapter, prompt, longstraw, prefix_grad)
    measured = state.retained_bytes()
    state.release()
    estimate = retained_per_rank(_tiny_shape(dtype, layers=8), prompt_len, 1, mode.removesuffix("-keep"), chunk, keep)
    for key in ("attention_kv_pages", "gdn_state", "carry_checkpoints", "kept_attention_pages"):
        assert estimate[key] == measured[key], key
    assert (measured["kept_attention_pages"] > 0) == (keep and prompt_len > 1)


@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_glm_retained_bytes_match_a_real_capture(mode):
    """glm_moe_dsa: latent + rope key pages on every layer, indexer-key pages on "full" indexer layers only,
    gradient pages for the latent streams only (the indexer key takes no gradient), and in exact mode the kept
    selections that prefix_keep_attention "auto" (the default) keeps on one rank, against a real capture and exact
    run of the tiny model; the planner resolves "auto" as the transaction does (offload/auto.keeps_attention)."""
    from glm_models import tiny_glm_moe_dsa, tiny_glm_moe_dsa_config

    from ds_longstraw.offload.auto import keeps_attention

    prompt_len = 45
    model = tiny_glm_moe_dsa(torch.float64)
    gen = torch.Generator().manual_seed(2)
    group = GRPOGroup(torch.randint(0, 97, (prompt_len,), generator=gen), [torch.randint(0, 97, (3,), generator=gen)],
                      rewards=[1.0])
    result = grpo_backward(model, group, longstraw={"prefix_grad": mode, "capture_chunk": 16, "page_tokens": 7})
    shape = shape_from_config("tiny-glm", tiny_glm_moe_dsa_config().to_dict(), 8)
    keep = keeps_attention("auto", mode, 1, bool(shape.selecting))
    assert keep == (mode == "exact") and not keeps_attention("auto", mode, 2, bool(shape.selecting))
    estimate = retained_per_rank(shape, prompt_len, 1, mode, 16, keep)
    for key in ("mla_latent_pages", "indexer_key_pages"):
        assert estimate[key] == result.retained_bytes[key] > 0, key
    assert estimate["gradient_pages"] == result.grad_page_bytes == (
        (prompt_len - 1) * 4 * (24 + 8) * 8 if mode == "exact" else 0)  # 4 layers of latent 24 + rope key 8
    # 2 full indexer layers keep index_topk (8) int32 positions per token
    assert estimate["kept_attention_pages"] == result.retained_bytes["kept_attention_pages"] == (
        (prompt_len - 1) * 2 * 8 * 4 if mode == "exact" else 0)


def test_gradient_pages_match_a_real_exact_run():
    model = tiny_qwen3_5()
    gen = torch.Generator().manual_seed(1)
    group = GRPOGroup(torch.randint(0, 97, (11,), generator=gen), [torch.randint(0, 97, (2,), generator=gen)],
                      rewards=[1.0])
    with float64_model():
        result = grpo_backward(model, group, longstraw={"prefix_grad": "exact", "capture_chunk": 4, "page_tokens": 3})
    estimate = retained_per_rank(_tiny_shape(torch.float64), 11, 1, "exact", 4)
    assert estimate["gradient_pages"] == result.grad_page_bytes > 0
    assert estimate["attention_kv_pages"] == result.retained_bytes["attention_kv_pages"]


def test_builtin_shapes_match_the_published_numbers():
    qwen = shape_from_config(*load_config("qwen3.6-27b"))
    assert qwen.bytes_per_token == 64 * 1024
    assert qwen.layer_counts == {"full_attention": 16, "linear_attention": 48}
    per_rank = retained_per_rank(qwen, 2_097_152 + 1, 8, "detached", 4096)
    assert per_rank["attention_kv_pages"] == 17_179_869_184  # 17.2 GB per rank on CP8
    assert per_rank["gdn_state"] == 48 * (48 * 128 * 128 * 4 + 10240 * 3 * 2)  # fp32 state + bf16 conv tail
    assert 26e9 < qwen.params < 28e9
    glm = shape_from_config(*load_config("glm-5.2"))
    assert glm.bytes_per_token == 95_232
    assert glm.layer_counts == {"mla_full_indexer": 21, "mla_shared_indexer": 57}
    assert glm.page_layers == {"mla_latent_pages": 78, "indexer_key_pages": 21}
    assert glm.grad_bytes_per_token == 78 * 1152  # the indexer keys take no gradient: no gradient pages
    per_rank = retained_per_rank(glm, 2_097_152 + 1, 32, "detached", 4096)
    assert round(sum(v for k, v in per_rank.items() if k.endswith("_pages")) / GiB, 2) == 5.81  # paper: 5.8125 GiB
    assert 7.0e11 < glm.params < 7.8e11


def test_gdn_checkpoints_are_planned_with_the_pages():
    """Exact mode's GDN carry checkpoints (Qwen3.6-27B, CP8, 2M tokens: 64 segments of about 150 MB a rank) count
    against the pages' tier: the GPU on tier none, host memory or NVMe otherwise, where the GPU holds two (one read
    ahead)."""
    from ds_longstraw.offload.plan import _needs

    qwen = shape_from_config(*load_config("qwen3.6-27b"))
    retained = retained_per_rank(qwen, 2_097_152 + 1, 8, "exact", 4096)
    checkpoints = retained["carry_checkpoints"]
    assert checkpoints == 64 * qwen.carry_total > 9e9
    pages = sum(v for k, v in retained.items() if k.endswith("_pages"))
    tokens = 2_097_152 // 8
    none, cpu, nvme = (_needs(qwen, tokens, retained, tier, 1) for tier in ("none", "cpu", "nvme"))
    assert none["gpu"] >= pages + checkpoints and none["host"] == none["nvme"] == 0
    assert cpu["host"] == pages + checkpoints
    assert nvme["nvme"] == pages + checkpoints
    for needs in (cpu, nvme):  # off the device: the resident GDN state and two staged checkpoints, not all 64
        assert retained["gdn_state"] + 2 * qwen.carry_total <= needs["gpu"] < checkpoints


def test_recommends_the_first_tier_that_fits():
    qwen = shape_from_config(*load_config("qwen3.6-27b"))

    def plan(gpu, host, nvme=None, context=2 * 2**20, response=1024):
        cluster = Cluster(gpus=8, cp=8, gpus_per_node=8, gpu_memory=int(gpu * GiB), host_memory=int(host * GiB),
                        nvme_free=None if nvme is None else int(nvme * GiB))
        return make_plan(qwen, context, 8, "exact", cluster, response_tokens=response)

    # H200, 2M tokens: the pages and gradient pages (32 GiB), the layer-major prefix pass's layer inputs (47.5 GiB)
    # and one replayed member's graph (30 GiB at 1,024 LoRA response tokens) exceed the GPU: the host tier; at 1M
    # they fit on the GPU
    assert plan(141, 2048).tier == "cpu"
    assert plan(141, 2048, context=2**20).tier == "none"
    assert plan(80, 2048).tier == "cpu"
    assert plan(80, 64, nvme=4096).tier == "nvme"
    assert plan(80, 64, nvme=8).tier is None
    # 40 GiB: a 1,024-token member's graph alone (30 GiB) leaves no room; 256-token members fit the host tier
    assert plan(40, 2048).tier is None and plan(40, 2048, response=256).tier == "cpu"
    p = plan(80, 2048)
    for tier in ("none", "cpu", "nvme"):
        longest = p.max_context[tier]
        if longest:  # the longest prompt fits that tier, and a longer one does not
            assert _fits(qwen, longest, tier)
            assert not _fits(qwen, longest + 1024, tier)


def _fits(shape, context, tier):
    cluster = Cluster(gpus=8, cp=8, gpus_per_node=8, gpu_memory=80 * GiB, host_memory=2048 * GiB)
    return make_plan(shape, context, 8, "exact", cluster).fits[tier]


def test_cli_reports_and_recommends(capsys, tmp_path):
    assert main(["--model", "glm-5.2", "--context", "2M", "--gpus", "32", "--gpu-memory", "96GB",
                 "--host-memory", "2TB", "--prefix-grad", "exact"]) == 0
    out = capsys.readouterr().out
    assert "mla_latent_pages" in out and "indexer_key_pages" in out and "Recommended:" in out
    # --keep-attention: "auto" keeps GLM-5.2's selections on one rank (21 full indexer layers x 2,048 int32
    # positions a token), not under CP (the sparse layers keep nothing there yet); "false" keeps nothing
    kept = {}
    for gpus, keep in (("1", "auto"), ("1", "false"), ("2", "auto")):
        assert main(["--model", "glm-5.2", "--context", "128K", "--gpus", gpus, "--gpu-memory", "141GB",
                     "--host-memory", "2TB", "--prefix-grad", "exact", "--keep-attention", keep, "--json"]) == 0
        kept[gpus, keep] = json.loads(capsys.readouterr().out)["retained_bytes_per_rank"]["kept_attention_pages"]
    assert kept == {("1", "auto"): (128 * 1024 - 1) * 21 * 2048 * 4, ("1", "false"): 0, ("2", "auto"): 0}
    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny_qwen3_5_config(layers=8).to_dict()))  # attention layers 3 and 7
    assert main(["--model", str(config), "--context", "100K", "--gpu-memory", "1GiB", "--host-memory", "2GiB",
                 "--nvme-path", str(tmp_path), "--dtype-bytes", "4", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["tokens_per_rank"] == 100 * 1024 - 1
    assert plan["retained_bytes_per_rank"]["attention_kv_pages"] == (100 * 1024 - 1) * 2 * 2 * 2 * 16 * 4
    assert plan["recommended_tier"] == "none"
    assert main(["--model", str(config), "--context", "100K", "--gpu-memory", "1GiB", "--prefix-grad", "exact",
                 "--keep-attention", "--dtype-bytes", "4", "--json"]) == 0
    with_pages = json.loads(capsys.readouterr().out)
    kept = with_pages["retained_bytes_per_rank"]["kept_attention_pages"]
    # 4 heads: out (16 dims) + lse, of one attention layer: one rank keeps none of the last layer's, which its
    # capture runs for its rows alone
    assert kept == (100 * 1024 - 1) * 1 * 4 * (16 * 4 + 4)
    assert main(["--model", str(config), "--context", "100K", "--gpu-memory", "1GiB", "--prefix-grad", "exact",
                 "--keep-attention", "--kept-attention-tier", "nvme", "--dtype-bytes", "4", "--json"]) == 0
    on_nvme = json.loads(capsys.readouterr().out)["needs"]["none"]
    assert on_nvme["nvme"] == kept and on_nvme["gpu"] == with_pages["needs"]["none"]["gpu"] - kept
    # under context parallelism each rank keeps its own tokens' attention
    assert main(["--model", str(config), "--context", "100K", "--gpus", "2", "--gpu-memory", "1GiB", "--prefix-grad",
                 "exact", "--keep-attention", "--dtype-bytes", "4", "--json"]) == 0
    sharded = json.loads(capsys.readouterr().out)
    assert sharded["retained_bytes_per_rank"]["kept_attention_pages"] == (100 * 1024 // 2) * 2 * 4 * (16 * 4 + 4)
    assert main(["--model", "no-such-model", "--context", "1M", "--gpu-memory", "1", "--host-memory", "1"]) == 2
    assert "neither a built-in shape" in capsys.readouterr().err


def test_parsers(capsys):
    """The planner's sizes (ds_longstraw.sizes): memory in bytes with a bare number counting GiB, prompts in tokens
    with K and M powers of 1024; a bad value is argparse's error naming the option and the value."""
    assert parse_tokens("2M") == 2_097_152 and parse_tokens("128K") == 131_072 and parse_tokens("4096") == 4096
    assert parse_bytes("96GB", bare=GiB) == 96_000_000_000 and parse_bytes("80GiB", bare=GiB) == 80 * GiB
    assert parse_bytes("2", bare=GiB) == 2 * GiB
    with pytest.raises(ValueError, match="'lots' is not a size in bytes"):
        parse_bytes("lots", bare=GiB)
    with pytest.raises(SystemExit):
        main(["--model", "qwen3.6-27b", "--context", "1M", "--gpu-memory", "lots"])
    assert "argument --gpu-memory: 'lots' is not a size in bytes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--model", "qwen3.6-27b", "--context", "2MB"])
    assert "argument --context: '2MB' is not a token count" in capsys.readouterr().err


def test_expert_shape_matches_a_real_model():
    """expert_shape reads a config alone; the counts equal those of a built model's MoE blocks (the dense first
    layer excluded), so the planner's weights follow the module's own parameters."""
    from glm_models import tiny_glm_moe_dsa, tiny_glm_moe_dsa_config

    from ds_longstraw.arch.glm_moe_dsa_experts import moe_blocks

    model = tiny_glm_moe_dsa(torch.float32)
    blocks = moe_blocks(model)
    shape = shape_from_config("tiny-glm", tiny_glm_moe_dsa_config().to_dict(), 4)
    moe = shape.moe
    assert (moe.experts, moe.experts_per_token, moe.hidden_size, moe.layers) == (6, 2, 64, 3)
    assert moe.routed_params == sum(p.numel() for p in blocks[0].experts.parameters()) == 6 * 3 * 32 * 64
    assert moe.block_params == sum(p.numel() for p in blocks[0].parameters())
    assert moe.layers * moe.block_params + sum(
        p.numel() for layer in model.model.layers if layer.mlp not in blocks for p in layer.mlp.parameters()) == sum(
        p.numel() for layer in model.model.layers for p in layer.mlp.parameters())
    assert shape_from_config(*load_config("qwen3.6-27b")).moe is None


def test_glm_expert_parallel_figures_by_hand():
    """GLM-5.2 on 32 GPUs, CP32 = EP32, 2M tokens, bf16: 256 experts x 3 x 6144 x 2048 per MoE layer, 75 MoE layers
    (78 less 3 dense), top-8, hidden 6144."""
    glm = shape_from_config(*load_config("glm-5.2"))
    routed_layer = 256 * 3 * 6144 * 2048  # gate_up [2 x 2048, 6144] + down [6144, 2048] per expert
    assert routed_layer == 9_663_676_416  # ~19.3 GB a layer in bf16
    routed = 75 * routed_layer
    other = glm.params - routed
    cluster = Cluster(gpus=32, cp=32, ep=32, gpus_per_node=8, gpu_memory=96 * 10**9)
    plan = make_plan(glm, 2_097_152 + 1, 8, "detached", cluster)
    m = plan.moe
    assert (m["layers"], m["experts"], m["experts_per_token"], m["routed_params"]) == (75, 256, 8, routed)
    assert m["weights_per_rank_zero3"] == int(glm.params * 2 / 32)
    assert m["weights_per_rank_ep"] == int(routed * 2 / 32 + other * 2 / 32)
    assert plan.weights_per_rank == m["weights_per_rank_ep"]  # what the GPU budget is left after
    # without EP a call of a MoE block gathers it whole: routed experts + router [256, 6144] + shared expert
    block = routed_layer + 256 * 6144 + 3 * 2048 * 6144
    assert m["zero3_gather_bytes_per_moe_call"] == block * 2 == 19_405_996_032
    assert m["zero3_gather_bytes_per_moe_call_ep"] == (256 * 6144 + 3 * 2048 * 6144) * 2  # 78.6 MB
    assert m["capture_moe_calls"] == 65_536 // 4096 * 75  # 16 capture chunks per rank, each calls every MoE layer
    # all-to-all: 8 pairs x 6144 x 2 B out and back per token and MoE layer; 31/32 of the pairs leave the rank
    assert m["alltoall_bytes_per_layer_token"] == 2 * 8 * 6144 * 2 == 196_608
    assert m["alltoall_leaving_bytes_per_layer_token"] == 196_608 * 31 / 32 == 190_464
    assert m["alltoall_leaving_bytes_capture"] == 190_464 * 75 * 65_536
    # EP 8 over data-parallel ranks (no CP): a rank holds a quarter of what it would at EP 32, plus the rest / 32
    ep8 = make_plan(glm, 2 * 2**20, 8, "detached", Cluster(gpus=32, cp=1, ep=8)).moe
    assert ep8["weights_per_rank_ep"] == int(routed * 2 / 8 + other * 2 / 32)
    assert ep8["alltoall_leaving_bytes_per_layer_token"] == 196_608 * 7 / 8


def test_cli_expert_parallel(capsys, tmp_path):
    args = ["--model", "glm-5.2", "--context", "2M", "--gpus", "32", "--gpu-memory", "96GB", "--host-memory", "2TB"]
    assert main(args + ["--cp", "32", "--ep", "32"]) == 0
    out = capsys.readouterr().out
    assert "EP 32 + ZeRO-3" in out and "190,464 B per MoE layer and token" in out and "UNIFORM ROUTING" in out
    assert "19.41 GB per call" in out
    assert main(args + ["--cp", "32", "--ep", "32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["experts"]["alltoall_bytes_per_layer_token"] == 196_608
    assert main(args) == 0  # --ep 1: ZeRO-3's gather of a whole MoE block is still reported
    out = capsys.readouterr().out
    assert "19.41 GB per call" in out and "all-to-all per MoE layer" not in out
    assert main(args + ["--json"]) == 0
    no_ep = json.loads(capsys.readouterr().out)
    assert no_ep["experts"]["weights_per_rank_ep"] is None
    assert no_ep["weights_per_rank"] == no_ep["experts"]["weights_per_rank_zero3"]
    # --cp defaults to every GPU: an EP size other than 32 is refused, naming the flags
    assert main(args + ["--ep", "8"]) == 2
    err = capsys.readouterr().err
    assert "--ep 8 with --cp 32" in err and "must equal --cp" in err
    assert main(args + ["--cp", "1", "--ep", "3"]) == 2
    assert "--ep 3 must divide --gpus 32" in capsys.readouterr().err
    assert main(args + ["--cp", "1", "--ep", "32"]) == 0  # EP over data-parallel ranks
    capsys.readouterr()
    assert main(["--model", "qwen3.6-27b", "--context", "1M", "--gpus", "8", "--ep", "8", "--gpu-memory", "96GB",
                 "--host-memory", "2TB"]) == 2
    err = capsys.readouterr().err
    assert "--ep 8" in err and "no routed experts" in err
    assert main(["--model", "qwen3.6-27b", "--context", "1M", "--gpus", "8", "--gpu-memory", "96GB",
                 "--host-memory", "2TB"]) == 0
    assert "Routed experts" not in capsys.readouterr().out
    from glm_models import tiny_glm_moe_dsa_config

    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny_glm_moe_dsa_config().to_dict()))
    assert main(["--model", str(config), "--context", "1K", "--gpus", "4", "--cp", "1", "--ep", "4",
                 "--gpu-memory", "1GiB", "--host-memory", "2GiB"]) == 2
    assert "--ep 4 must divide the 6 routed experts" in capsys.readouterr().err


def test_kernel_workspaces_are_counted_on_the_gpu():
    """The log-prob, attention and delta-rule scratch of Qwen3.6-27B's shape, by hand (float32): a 1,024-token
    replay block over an 8,192-id vocabulary chunk (logits, probabilities, their gradient) plus d(hidden); flash's
    dq accumulator and lse over a capture chunk's 24 heads of 256, plus one backward call's bf16 dK/dV over 16,384
    keys (per query head, then per KV head: 24 + 4); the delta rule's scratch over 48 value heads of 128 + 128
    (plan.delta_rule_floats, measured by the next test): in detached mode the larger of the capture chunk's
    forward and a replay block's forward + backward, in exact mode forward + backward over the capture chunk.
    The largest is added to every tier's GPU need."""
    from ds_longstraw.kernels import VOCAB_CHUNK
    from ds_longstraw.kernels.attention import LIBRARY_KEY_BLOCK
    from ds_longstraw.offload import plan as plan_module

    assert plan_module.VOCAB_CHUNK == VOCAB_CHUNK and plan_module.LIBRARY_KEY_BLOCK == LIBRARY_KEY_BLOCK
    shape = shape_from_config(*load_config("qwen3.6-27b"))
    cluster = Cluster(gpus=8, cp=8, gpu_memory=96 * GiB)
    plan = make_plan(shape, 1 << 20, 8, "detached", cluster, capture_chunk=4096)
    assert plan.workspace == {"logprobs": 1024 * (3 * 8192 + 5120) * 4,
                              "attention": 24 * 4096 * 257 * 4 + 2 * (24 + 4) * 16384 * 256 * 2,
                              "delta_rule": 48 * max(4096 * (8 * 256 + 256 * 256 // 128 + 12 * 64),
                                                     1024 * (16 * 256 + 256 * 256 // 64 + 32 * 64)) * 4,
                              # CP: the GDN scan's [o(0) | q~] over the 131,072 tokens of a rank (bf16), with the
                              # augmented run's scratch (value width 256 + 128) over a capture chunk
                              "gdn_scan": 131072 * 48 * 256 * 2
                              + 48 * 4096 * (8 * 384 + 384 * 384 // 128 + 12 * 64) * 4}
    exact = make_plan(shape, 1 << 20, 8, "exact", cluster, capture_chunk=4096)
    assert exact.workspace["delta_rule"] == 48 * 4096 * (16 * 256 + 256 * 256 // 64 + 32 * 64) * 4
    bare = plan_module._needs(shape, plan.tokens_per_rank, plan.retained, "none", 1)
    # beside the pages: the largest phase's scratch, where the replay's is one member's graph (1,024 response
    # tokens, LoRA: arch/qwen3_5_graph.py) with the kernels that run inside it (not the CP scan's outputs, which the
    # capture holds)
    replay = plan.replay_graph + max(plan.workspace[k] for k in ("logprobs", "attention", "delta_rule"))
    assert plan.replay_graph == 1024 * shape.replay_graph["lora"][0] + shape.replay_graph["lora"][1]
    assert plan.needs["none"]["gpu"] - bare["gpu"] == max(max(plan.workspace.values()), replay)
    full = make_plan(shape, 1 << 20, 8, "detached", cluster, capture_chunk=4096, trains="full")
    assert full.trained_grads == full.weights_per_rank > 0  # every weight trained: its gradients, the weights' share
    assert full.needs["none"]["gpu"] - bare["gpu"] == max(max(full.workspace.values()),
                                                          full.replay_graph + replay - plan.replay_graph
                                                          ) + full.trained_grads
    glm = shape_from_config(*load_config("glm-5.2"))
    assert glm.attention_head_dim == 512 + 64 and glm.delta_heads == 0  # absorbed MLA reads latent + rope


PEAK = r"""
import sys, torch
from ds_longstraw.kernels import chunk_gated_delta_rule
from ds_longstraw.grpo.memory import host_current_bytes, host_peak_bytes, reset_host_peak
torch.set_num_threads(1)
tokens, heads, dim, grad = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "backward"
gen = torch.Generator().manual_seed(0)
q, k = (torch.randn(1, tokens, heads // 3, dim, generator=gen).requires_grad_(grad) for _ in range(2))
v = torch.randn(1, tokens, heads, dim, generator=gen).requires_grad_(grad)
g = (-torch.rand(1, tokens, heads, generator=gen) * 0.1).requires_grad_(grad)
beta = torch.rand(1, tokens, heads, generator=gen).requires_grad_(grad)
h0 = torch.zeros(1, heads, dim, dim, requires_grad=grad)
args = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
chunk_gated_delta_rule(q[:, :64], k[:, :64], v[:, :64], g[:, :64], beta[:, :64], **args)  # warm the allocator
reset_host_peak()
base = host_current_bytes()
with torch.set_grad_enabled(grad):
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, **args)
    if grad:
        torch.autograd.grad(out.sum() + final.sum(), (q, k, v, g, beta, h0))
print(host_peak_bytes() - base)
"""


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward+backward"])
def test_delta_rule_workspace_bounds_the_measured_peak(backward):
    """plan.delta_rule_floats against the project's kernel in a fresh process (the kernel's high-water mark above
    its inputs, 8,192 tokens, 6 value heads of 64 + 64, the 64-token chunk): the planner's figure is at least the
    measured peak (it is what the planner reserves) and at most 1.6x it (so it does not crowd out the pages).
    Measured over four runs each: 0.83-0.87x of the figure forward and 0.85-0.89x forward + backward (the peak
    moves by about 5% from run to run, with the allocator's state)."""
    import subprocess
    import sys

    from ds_longstraw.offload.plan import delta_rule_floats

    tokens, heads, dim = 8192, 6, 64
    run = subprocess.run([sys.executable, "-c", PEAK, str(tokens), str(heads), str(dim),
                          "backward" if backward else "forward"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    measured = int(run.stdout.split()[-1])
    planned = delta_rule_floats(2 * dim, backward) * 4 * tokens * heads
    assert measured <= planned <= 1.6 * measured, (measured, planned)


@pytest.mark.parametrize("family", ["qwen3_5", "glm_moe_dsa"])
def test_rollout_state_matches_what_generate_allocates(family, monkeypatch):
    """offload/plan.rollout_figures against a real batched generate of the tiny model (float64, no eos, so every
    sample runs to max_new_tokens): the samples' response-row buffers generate allocates (rollout._new_buffer) are
    G x new tokens x the page streams' bytes per token, and the carry the first decode step receives is G copies of
    the prompt's per-sequence carry; both to the byte."""
    import ds_longstraw.rollout.generate as rollout
    from ds_longstraw import generate

    if family == "qwen3_5":
        model, config = tiny_qwen3_5(), tiny_qwen3_5_config().to_dict()
    else:
        from glm_models import tiny_glm_moe_dsa, tiny_glm_moe_dsa_config

        model, config = tiny_glm_moe_dsa(), tiny_glm_moe_dsa_config().to_dict()
    samples, new_tokens, prompt_len = 3, 5, 45
    rows, carries = [], []
    real_buffer, adapter = rollout._new_buffer, adapter_for(model)
    real_step = type(adapter).decode_step

    def buffer(part, capacity):
        out = real_buffer(part, capacity)
        rows.append(out.nbytes)
        return out

    def step(self, tokens, start, carry, *args, **kwargs):
        if not carries:
            carries.append(sum(t.nbytes for parts in carry.values() for t in parts))
        return real_step(self, tokens, start, carry, *args, **kwargs)

    monkeypatch.setattr(rollout, "_new_buffer", buffer)
    monkeypatch.setattr(type(adapter), "decode_step", step)
    prompt = torch.randint(0, 97, (prompt_len,), generator=torch.Generator().manual_seed(3))
    with float64_model():
        result = generate(model, prompt, samples, new_tokens, seed=0, longstraw={"capture_chunk": 16, "page_tokens": 7})
    assert [len(ids) for ids in result.response_ids] == [new_tokens] * samples
    plan = make_plan(shape_from_config("tiny", config, 8), prompt_len, samples, "detached", Cluster())
    figures = rollout_figures(plan, new_tokens)
    assert sum(rows) == samples * figures["rows_per_sample"] > 0
    assert carries == [samples * figures["carry_per_sample"]]
    assert (carries[0] > 0) == (family == "qwen3_5")  # Gated DeltaNet's state; MLA keeps none
    assert figures["samples"] == sum(rows) + carries[0]


def test_cli_sizes_rollouts(capsys):
    """--new-tokens: the samples' own state (qwen3.6-27b: 65,536 B of K/V rows per token over its 16 attention
    layers, the Gated DeltaNet carry per sample), the GPU while decoding per tier with the weights per call and
    whole, and the longest response that fits; refused by name below 1."""
    base = ["--model", "qwen3.6-27b", "--context", "2M", "--gpus", "8", "--gpu-memory", "141GB",
            "--host-memory", "2TB", "--group-size", "8"]
    assert main(base + ["--new-tokens", "32K", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    r = plan["rollout"]
    assert r["rows_per_sample"] == 65536 * 32 * 1024
    assert r["samples"] == 8 * (r["carry_per_sample"] + r["rows_per_sample"])
    params = shape_from_config(*load_config("qwen3.6-27b")).params
    assert r["whole_weights_extra"] == int(params * 2.0) - plan["weights_per_rank"]
    # none of the training step's scratch is live while decoding: its kernels' nor a replayed member's graph
    workspace = max(max(plan["workspace_bytes"].values()), plan["replay_graph_bytes"] + max(
        plan["workspace_bytes"][k] for k in ("logprobs", "attention", "delta_rule")))
    for tier in ("none", "cpu", "nvme"):
        per_call, whole = r["per_call"], r["whole"]
        assert per_call["gpu"][tier] == plan["needs"][tier]["gpu"] - workspace + r["samples"] + r["logits"]
        assert whole["gpu"][tier] == per_call["gpu"][tier] + r["whole_weights_extra"]
        assert whole["longest"][tier] < per_call["longest"][tier]
        # the longest response fits, one more token's rows for every sample would not (to rounding of the floor)
        longest = per_call["longest"][tier]
        used = plan["needs"][tier]["gpu"] - workspace + r["logits"] + 8 * (r["carry_per_sample"] + 65536 * longest)
        assert used <= plan["budgets"]["gpu"] < used + 8 * 65536
    assert main(base + ["--new-tokens", "32K"]) == 0
    out = capsys.readouterr().out
    assert "## Rollouts (generate)" in out and "zero3_weights: whole" in out
    assert main(base + ["--new-tokens", "0"]) == 2
    assert "--new-tokens 0" in capsys.readouterr().err
    # the recommendation must decode too: 200K new tokens per sample no longer fit beside the pages on the GPU
    assert plan["recommended_tier"] == "none"
    assert main(base + ["--new-tokens", "200K", "--json"]) == 0
    long = json.loads(capsys.readouterr().out)
    assert long["fits"]["none"] and long["rollout"]["per_call"]["fits"] == {"none": False, "cpu": True, "nvme": True}
    assert long["recommended_tier"] == "cpu"


def test_cp_time_prediction_follows_its_stated_model(capsys):
    """tools/cp_time.py: the fit passes through BENCHMARKS.md's two H200 points; at CP 2 the zigzag layout's
    attention share is 1/2 against contiguous shards' 3/4; the turns' prefix pass costs one GPU's pass, the
    layer-major one 3x a rank's zigzag share plus the GDN adjoint summaries; for a family that selects, the
    selection's pairs are L^2 (2N - 1) / 2N^2 on the last contiguous rank against L^2 / 2N on zigzag ones, and the
    Triton figures give its per-pair and per-query costs; the CLI prints both tables."""
    from ds_longstraw.offload.kind_costs import AttentionCost, KindCost, ScanCost, SparseCost
    from ds_longstraw.offload.state_shape import ModelShape
    from ds_longstraw.tools import cp_time

    def hybrid(attention_rule="lse"):  # the benchmarked four layers of the 27B: 1 attention + 3 Gated DeltaNet
        return ModelShape(name="four", family="qwen3_5", dtype_bytes=2,
                          combine_counts={attention_rule: 1, "affine_scan": 3},
                          kind_costs={attention_rule: AttentionCost(), "affine_scan": ScanCost()})

    fit = [4 * cp_time.LINEAR_S_PER_TOKEN_LAYER * n + cp_time.ATTENTION_S_PER_L2 * n * n for n in (65536, 262144)]
    assert fit == pytest.approx([0.97, 5.12], rel=1e-12)
    times = cp_time.predict(hybrid(), 262144, 2, cp_time.H200_TFLOPS)
    a4, b, r = cp_time.LINEAR_S_PER_TOKEN_LAYER, cp_time.ATTENTION_S_PER_L2, cp_time.RECURRENCE_S_PER_TOKEN
    attention, tokens = b * 262144 ** 2, 131072
    assert times["now"].capture == pytest.approx(4 * a4 * tokens + attention / 2 + 3 * r * tokens, rel=1e-12)
    assert times["before"].capture == pytest.approx(
        4 * a4 * tokens + attention * 3 / 4 + 3 * (2 * r + cp_time.IN_PROJ_SHARE * a4) * tokens, rel=1e-12)
    assert times["turns_prefix"] == times["before"].prefix == pytest.approx(3 * (4 * a4 * 262144 + attention),
                                                                           rel=1e-12)
    assert times["now"].prefix == pytest.approx(3 * (4 * a4 * tokens + attention / 2) + 2 * r * 3 * tokens,
                                                rel=1e-12)
    strided = cp_time.predict(hybrid(), 262144, 2, cp_time.H200_TFLOPS, inputs_every=4)
    assert strided["now"].prefix - times["now"].prefix == pytest.approx(0.75 * (4 * a4 * tokens + attention / 2),
                                                                        rel=1e-12)
    slower = cp_time.predict(hybrid(), 262144, 2, cp_time.H200_TFLOPS / 2)
    assert slower["now"].capture == pytest.approx(2 * times["now"].capture, rel=1e-12)
    # the seconds hang on the kind, not on its rule's name: a new rule with attention's cost predicts as "lse"
    assert cp_time.predict(hybrid("windowed"), 262144, 2, cp_time.H200_TFLOPS) == times
    # a kind without a time model: no prediction, and the rule is named
    unknown = dataclasses.replace(hybrid(), combine_counts={"lse": 1, "affine_scan": 2, "counted": 1},
                                  kind_costs={**hybrid().kind_costs, "counted": KindCost()})
    assert cp_time.predict(unknown, 262144, 2, 148.0) is None and cp_time.unmodelled(unknown) == ["counted"]
    assert main(["--model", "qwen3.6-27b", "--context", "2M", "--gpus", "8", "--gpu-memory", "96GB",
                 "--host-memory", "1TB"]) == 0
    out = capsys.readouterr().out
    assert "## Context parallelism: predicted seconds per rank (148 dense bf16 TFLOPS per GPU)" in out
    assert "| exact prefix pass, layer-major |" in out and "| exact prefix pass, turns |" in out
    assert "Exact mode here runs the prefix pass layer-major (longstraw.cp_prefix auto" in out
    assert "keeping every 4-th layer's input (longstraw.prefix_inputs_every auto" in out
    assert main(["--model", "glm-5.2", "--context", "2M", "--gpus", "32", "--ep", "32", "--gpu-memory", "96GB",
                 "--host-memory", "1TB"]) == 0
    out = capsys.readouterr().out
    assert "| capture |" in out and "| exact prefix pass, turns |" in out and "layer-major" in out
    assert "39.3B active parameters a token" in out  # 743.4B less the embeddings and 248/256 of the routed experts
    # "auto" runs GLM-5.2 layer-major here: its inputs fit the tier's ratio at k = 13, and the 15 GiB it holds on
    # a 96 GB GPU a quarter of it; on 48 GB GPUs it takes the turns, and the plan says where layer-major fits anyway
    assert "Exact mode here runs the prefix pass layer-major (longstraw.cp_prefix auto" in out
    assert "keeping every 13-th layer's input" in out
    assert main(["--model", "glm-5.2", "--context", "2M", "--gpus", "32", "--ep", "32", "--gpu-memory", "48GB",
                 "--host-memory", "1TB"]) == 0
    out = capsys.readouterr().out
    assert "Exact mode here runs the prefix pass turns (longstraw.cp_prefix auto" in out
    # 78 layers attending a top-k selection that 21 make, 40B active parameters a token (no embeddings counted)
    dsa = ModelShape(name="dsa", family="glm_moe_dsa", dtype_bytes=2, combine_counts={"topk_lse": 78},
                     kind_costs={"topk_lse": SparseCost()}, params=40e9, selecting=tuple(range(21)),
                     index_width=32 * 128, attention_heads=64, attention_head_dim=576, select_topk=2048)
    sparse = cp_time.predict(dsa, 262144, 4, cp_time.H200_TFLOPS)
    pair = 2.2e-3 / (1024 * 16384) * 21
    per_token = (cp_time.DENSE_S_PER_PARAM_TOKEN * 40e9 + 16.8e-3 / 1024 * 78) * 65536
    assert sparse["now"].capture == pytest.approx(per_token + pair * 262144 ** 2 / 8, rel=1e-12)
    assert sparse["before"].capture == pytest.approx(per_token + pair * 262144 ** 2 * 7 / 32, rel=1e-12)
    assert sparse["turns_prefix"] == sparse["before"].prefix
    assert sparse["now"].prefix == pytest.approx(
        (3 * cp_time.DENSE_S_PER_PARAM_TOKEN * 40e9 + 46.2e-3 / 1024 * 78) * 65536 + pair * 262144 ** 2 / 8, rel=1e-12)
    strided = cp_time.predict(dsa, 262144, 4, cp_time.H200_TFLOPS, inputs_every=8)
    # the recompute of 7 of every 8 layers' inputs: 7/8 of the zigzag capture again
    assert strided["now"].prefix - sparse["now"].prefix == pytest.approx(7 / 8 * sparse["now"].capture, rel=1e-12)
    assert cp_time.predict(dataclasses.replace(dsa, combine_counts={}), 262144, 4, 148.0) is None
    assert main(["--model", "qwen3.6-27b", "--context", "2M", "--gpus", "8", "--gpu-tflops", "0"]) == 2
    assert "--gpu-tflops 0.0" in capsys.readouterr().err


def test_auto_scan_holds_the_outputs_only_where_they_fit():
    """cp_scan "auto": at 2M tokens on 8 x 96 GB the GDN outputs (6 GiB a rank) are held (gdn_scan counted); at 16M
    (48 GiB a rank, over a quarter of the GPU) they are not, so the longest prompt the NVMe tier takes is the two-pass
    one, longer than forcing one_pass allows."""
    shape = shape_from_config(*load_config("qwen3.6-27b"))
    cluster = Cluster(gpus=8, cp=8, gpus_per_node=8, gpu_memory=96 * GiB, host_memory=1024 * GiB)
    assert "gdn_scan" in make_plan(shape, 2 << 20, 8, "detached", cluster).workspace
    assert "gdn_scan" not in make_plan(shape, 16 << 20, 8, "detached", cluster).workspace
    assert "gdn_scan" not in make_plan(shape, 2 << 20, 8, "detached", cluster, cp_scan="two_pass").workspace
    auto = make_plan(shape, 2 << 20, 8, "detached", cluster).max_context["nvme"]
    one_pass = make_plan(shape, 2 << 20, 8, "detached", cluster, cp_scan="one_pass").max_context["nvme"]
    assert auto > one_pass
    with pytest.raises(ValueError, match="cp_scan must be"):
        make_plan(shape, 2 << 20, 8, "detached", cluster, cp_scan="three_pass")


def test_layer_major_prefix_counts_its_inputs_and_workspace():
    """Exact mode under CP with qwen3_5, layer-major asked for with every layer's input: each layer's input over the
    shard is retained with the pages (hidden x dtype x layers per token), and what the pass holds across a layer is
    a workspace; the turns keep neither and fit longer prompts; "auto" keeps every 4th layer's input for
    Qwen3.6-27B (16 kept, 3 recomputed per group: 1.5x its state at most) and runs layer-major; glm_moe_dsa runs
    the turns under "auto" (every layer's input, 6,144 values a token x 78 layers, far outweighs its pages) and
    layer-major where asked for, with every layer's input."""
    shape = shape_from_config(*load_config("qwen3.6-27b"))
    cluster = Cluster(gpus=8, cp=8, gpus_per_node=8, gpu_memory=96 * GiB, host_memory=1024 * GiB,
                    nvme_free=3584 * GiB)
    plan = make_plan(shape, 2 << 20, 8, "exact", cluster, cp_prefix="layer_major", inputs_every=1)
    tokens = plan.tokens_per_rank
    assert sum(shape.combine_counts.values()) == 64  # 48 Gated DeltaNet + 16 attention layers
    assert plan.retained["layer_inputs"] == tokens * shape.hidden_size * shape.dtype_bytes * 64
    assert plan.workspace["layer_major_prefix"] > 0
    turns = make_plan(shape, 2 << 20, 8, "exact", cluster, cp_prefix="turns")
    assert turns.retained["layer_inputs"] == 0 and "layer_major_prefix" not in turns.workspace
    assert make_plan(shape, 2 << 20, 8, "detached", cluster).retained["layer_inputs"] == 0
    assert turns.max_context["nvme"] > plan.max_context["nvme"]
    # the inputs live with the pages: on the host tier they count against host memory
    assert plan.needs["cpu"]["host"] - turns.needs["cpu"]["host"] == plan.retained["layer_inputs"]
    # every 8th layer's input kept (8 of 64), 7 recomputed per group: 37.5 GiB on the tier instead of 160, and the
    # 2M-token step fits the host tier again
    strided = make_plan(shape, 2 << 20, 8, "exact", cluster, cp_prefix="layer_major", inputs_every=8)
    assert strided.retained["layer_inputs"] == plan.retained["layer_inputs"] // 8
    assert strided.retained["recomputed_inputs"] == 7 * plan.retained["layer_inputs"] // 64
    assert strided.fits["cpu"] and not plan.fits["cpu"]
    auto = make_plan(shape, 2 << 20, 8, "exact", cluster)
    assert auto.inputs_every == 4 and auto.inputs_every_asked == "auto"
    assert auto.retained["layer_inputs"] == plan.retained["layer_inputs"] // 4
    assert auto.retained["recomputed_inputs"] == 3 * plan.retained["layer_inputs"] // 64
    assert auto.fits["cpu"]
    with pytest.raises(ValueError, match="inputs_every must be 'auto' or at least 1"):
        make_plan(shape, 2 << 20, 8, "exact", cluster, inputs_every=0)
    glm = shape_from_config(*load_config("glm-5.2"))
    glm_layout = Cluster(gpus=32, cp=32, ep=32, gpus_per_node=8, gpu_memory=96 * GiB, host_memory=1024 * GiB)
    # "auto": layer-major keeping every 13th layer's input where what it holds fits a quarter of the GPU, not on 48 GB
    glm_auto = make_plan(glm, 2 << 20, 8, "exact", glm_layout)
    assert glm_auto.inputs_every == 13 and glm_auto.workspace["layer_major_prefix"] <= 0.25 * 96 * GiB
    assert glm_auto.retained["layer_inputs"] >= glm_auto.tokens_per_rank * 6144 * 2 * 6  # layers 0, 13, ..., 65
    small_gpus = dataclasses.replace(glm_layout, gpu_memory=48 * GiB)
    assert make_plan(glm, 2 << 20, 8, "exact", small_gpus).retained["layer_inputs"] == 0
    asked = make_plan(glm, 2 << 20, 8, "exact", glm_layout, cp_prefix="layer_major", inputs_every=1)
    assert asked.retained["layer_inputs"] == asked.tokens_per_rank * 6144 * 2 * 78  # every input: no selection kept
    strided = make_plan(glm, 2 << 20, 8, "exact", glm_layout, cp_prefix="layer_major", inputs_every=4)
    # the bases 0, 4, 8, ... that reuse a selection made by a layer whose input is not kept keep that selection too
    kinds = load_config("glm-5.2")[1].indexer_types
    made, bases = None, 0
    for layer, kind in enumerate(kinds):
        bases += layer % 4 == 0 and kind == "shared" and made is not None and made % 4 != 0
        made = layer if kind == "full" else made
    assert bases > 0
    assert strided.retained["layer_inputs"] == strided.tokens_per_rank * (6144 * 2 * 20 + bases * 2048 * 4)
    with pytest.raises(ValueError, match="cp_prefix must be"):
        make_plan(shape, 2 << 20, 8, "exact", cluster, cp_prefix="sideways")


@pytest.mark.parametrize("context,cp,chunk", [(23, 2, 4), (2_097_152, 8, 4096), (10, 4, 2), (1000, 3, 7)])
def test_zigzag_chunks_match_the_capture_chunks(context, cp, chunk):
    """offload/plan.zigzag_chunks (offload stands alone, so it sizes the segments itself) == the most chunks a rank's
    capture makes under the zigzag layout (parallel/groups.local_spans over shard_pieces)."""
    from ds_longstraw.offload.plan import zigzag_chunks
    from ds_longstraw.parallel import local_spans, shard_pieces

    pieces = shard_pieces(context - 1, cp, "zigzag")
    assert zigzag_chunks(context, cp, chunk) == max(len(local_spans(own, chunk)) for own in pieces)


def test_a_tool_span_in_steps_counts_its_rows_not_its_graph(capsys):
    """A member's tool span from member_span_capture tokens up runs in steps (grpo/member_steps.py): the plan
    counts its rows and their gradients (2 x L x the page bytes per token), the carry at each step's start and a
    graph over the actions, as the schedule cuts the steps; below the threshold, or with member_span_capture None,
    the graph spans the whole response."""
    from ds_longstraw.grpo.member_steps import member_steps
    from ds_longstraw.offload.plan import member_replay, replay_graph_bytes

    qwen = shape_from_config(*load_config("qwen3.6-27b"))
    cluster = Cluster(gpus=1, gpu_memory=141 * GiB)
    per_token = sum(qwen.page_bytes_per_token.values())
    steps = make_plan(qwen, 262144, 4, "detached", cluster, tool_tokens=16384)
    whole = make_plan(qwen, 262144, 4, "detached", cluster, tool_tokens=16384, member_span_capture=None)
    short = make_plan(qwen, 262144, 4, "detached", cluster, tool_tokens=512)
    assert steps.member_steps and not whole.member_steps and not short.member_steps
    assert steps.tool_rows == 2 * 16384 * per_token
    # 1,024-token steps (the action region's length) over the span, and the actions after it
    assert steps.tool_carries == (16 + 1) * qwen.carry_total > 0
    assert steps.replay_graph == replay_graph_bytes(qwen, 1024, "lora") + steps.tool_rows + steps.tool_carries
    assert whole.replay_graph == replay_graph_bytes(qwen, 1024 + 16384, "lora")
    assert short.replay_graph == replay_graph_bytes(qwen, 1024 + 512, "lora")
    assert steps.replay_graph < whole.replay_graph / 10
    # the planner's step is the schedule's: 100 action tokens around a 2,000-token span, replay_block 1,024
    mask = torch.tensor([True] * 50 + [False] * 2000 + [True] * 50)
    cut = {step.end - step.start for step in member_steps(mask, 1024, 1024) if not step.scored}
    assert max(cut) == member_replay(qwen, 50, 2000, 1024)["graph_tokens"] == 256
    # and its carries are the schedule's: one per step but the first (the prompt's carry)
    assert member_replay(qwen, 50, 2000, 1024)["tool_carries"] == (len(member_steps(mask, 1024, 1024)) - 1) * (
        qwen.carry_total)
    main(["--model", "qwen3.6-27b", "--context", "256K", "--gpus", "1", "--gpu-memory", "141G",
          "--tool-tokens", "16K"])
    assert "16,384-token tool span in steps" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--model", "qwen3.6-27b", "--context", "256K", "--tool-tokens", "-5"])


def test_groups_per_document_change_the_captures_not_the_memory(capsys):
    """--groups-per-document N: the memory is one group's (the document's pages and one question's at a time),
    the step captures the document once on one rank, and under CP or ZeRO-3 data parallelism in the flat form
    (grpo/flat_document.py): exact mode replays each question with its members, detached mode holds it."""
    base = ["--model", "qwen3.6-27b", "--context", "256K", "--gpu-memory", "141G", "--host-memory", "1T", "--json"]
    assert main([*base, "--gpus", "1"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert main([*base, "--gpus", "1", "--groups-per-document", "4"]) == 0
    shared = json.loads(capsys.readouterr().out)
    assert shared["groups_per_document"] == 4 and alone["groups_per_document"] == 1
    assert shared["needs"] == alone["needs"] and shared["retained_bytes_per_rank"] == alone["retained_bytes_per_rank"]
    assert main([*base[:-1], "--gpus", "1", "--groups-per-document", "4", "--prefix-grad", "exact"]) == 0
    text = capsys.readouterr().out
    assert "captures the document once instead of 4 times and runs one reverse pass over it" in text
    # under CP (or ZeRO-3 data parallelism) both modes share it in the flat form
    assert main([*base[:-1], "--gpus", "2", "--groups-per-document", "3"]) == 0
    text = capsys.readouterr().out
    assert "at CP 2 the document is captured once" in text and "each question held by each" in text
    assert main([*base[:-1], "--gpus", "2", "--groups-per-document", "3", "--prefix-grad", "exact"]) == 0
    text = capsys.readouterr().out
    assert "at CP 2 the document is captured once" in text and "each question replayed with each" in text
    assert main([*base[:-1], "--gpus", "2", "--cp", "1", "--groups-per-document", "3", "--prefix-grad",
                 "exact"]) == 0
    text = capsys.readouterr().out
    assert "captures the document once instead of 3 times" in text and "ZeRO-3 with several ranks" in text
    assert main([*base, "--groups-per-document", "0"]) == 2
    assert "--groups-per-document 0" in capsys.readouterr().err


def test_the_planner_asks_each_layer_kind_for_its_bytes():
    """offload/kind_costs.py: the bytes the CP schedules add are the kinds' own, found through the model's rules,
    not through their names. Qwen3.6-27B's attention layers declared under a new rule that carries attention's cost
    plan byte for byte as the built-in; under a rule whose cost is the base (holds nothing), the layer-major pass
    holds only d(output) and d(input) of those layers and the plan's workspace changes by exactly that; a rule
    without a scan's cost holds no GDN outputs across the exchange."""
    from ds_longstraw.offload.auto import gdn_scan_outputs, layer_major_workspace
    from ds_longstraw.offload.kind_costs import AttentionCost, KindCost

    qwen = shape_from_config(*load_config("qwen3.6-27b"))

    def renamed(rule, cost, old="lse"):
        counts = {(rule if name == old else name): n for name, n in qwen.combine_counts.items()}
        costs = {(rule if name == old else name): c for name, c in qwen.kind_costs.items()}
        return dataclasses.replace(qwen, combine_counts=counts, kind_costs={**costs, rule: cost})

    cluster = Cluster(gpus=8, cp=8, gpus_per_node=8, gpu_memory=141 * GiB, host_memory=2048 * GiB,
                      nvme_free=10 * 2**40)
    built_in = make_plan(qwen, 2 * 2**20, 8, "exact", cluster, cp_scan="one_pass")
    windowed = make_plan(renamed("windowed", AttentionCost()), 2 * 2**20, 8, "exact", cluster, cp_scan="one_pass")
    assert windowed.workspace == built_in.workspace and windowed.max_context == built_in.max_context
    tokens = 2**18
    attention_own = 3 * 24 * 256 * 2 + 24 * 4  # q, out, d(out) [24 x 256] in bf16, lse in float32
    gdn_own = 2 * 48 * 128 * 2  # d(o), d(z) [48 x 128] in bf16
    assert attention_own > gdn_own
    assert layer_major_workspace(qwen, tokens) - layer_major_workspace(renamed("plain", KindCost()), tokens) == (
        tokens * (attention_own - gdn_own))
    assert gdn_scan_outputs(qwen, tokens) == tokens * 48 * 256 * 2
    assert gdn_scan_outputs(renamed("plain", KindCost(), old="affine_scan"), tokens) == 0
    scanless = make_plan(renamed("plain", KindCost(), old="affine_scan"), 2 * 2**20, 8, "detached", cluster,
                         cp_scan="one_pass")
    assert "gdn_scan" in make_plan(qwen, 2 * 2**20, 8, "detached", cluster, cp_scan="one_pass").workspace
    assert "gdn_scan" not in scanless.workspace


def test_exact_prefix_pass_counts_the_selections_it_keeps():
    """GLM-5.2, exact mode on one rank: a prefix-pass segment keeps each full indexer layer's selection (int32
    [capture chunk, index_topk], 21 layers) for its layers' recompute, beside the attention's scratch; detached mode
    and the CP prefix pass (which does not recompute layers there) keep none, nor does a model without top-k
    layers."""
    glm = shape_from_config(*load_config("glm-5.2"))
    assert glm.select_topk == 2048 and len(glm.selecting) == 21
    one = Cluster(gpus=1, cp=1, gpu_memory=96 * GiB)
    exact = make_plan(glm, 1 << 17, 8, "exact", one, capture_chunk=4096)
    assert exact.workspace["prefix_selections"] == exact.workspace["attention"] + 4096 * 2048 * 4 * 21
    assert "prefix_selections" not in make_plan(glm, 1 << 17, 8, "detached", one, capture_chunk=4096).workspace
    cp2 = Cluster(gpus=2, cp=2, gpu_memory=96 * GiB)
    assert "prefix_selections" not in make_plan(glm, 1 << 17, 8, "exact", cp2, capture_chunk=4096).workspace
    qwen = shape_from_config(*load_config("qwen3.6-27b"))
    assert "prefix_selections" not in make_plan(qwen, 1 << 17, 8, "exact", one, capture_chunk=4096).workspace


def test_exact_staging_counts_the_sparse_backward_rows():
    """Exact mode's staging on the GPU holds one layer's page gradients in backward: for qwen3.6-27b the dense dK/dV
    of its largest staged layer in float32; for GLM-5.2 the sparse attention's rows laid out and their gradients
    (kernels/sparse_mla/selected_rows.py), [tokens, kv_lora_rank + qk_rope_head_dim = 576] float32 twice, more than
    its staged layer (latent, rope key and indexer key in bf16) in float32. The host tier's GPU need of exact mode
    less detached mode's is exactly that term (the gradient pages live on the host), once the scratch and graph
    beside the pages and exact mode's carry checkpoints are set apart."""
    one = Cluster(gpus=1, cp=1, gpu_memory=96 * GiB)
    tokens = 1 << 17
    for name, expected in [("glm-5.2", 2 * 576 * 4), ("qwen3.6-27b", None)]:
        shape = shape_from_config(*load_config(name))
        exact, detached = (make_plan(shape, tokens + 1, 8, mode, one, capture_chunk=4096) for mode in
                           ("exact", "detached"))
        # the kernels' scratch and the replay's graph apart, and exact mode's two carry checkpoints staged ahead
        term = (exact.needs["cpu"]["gpu"] - plan_module._live_beside_pages(exact) - 2 * shape.carry_total
                - detached.needs["cpu"]["gpu"] + plan_module._live_beside_pages(detached))
        dense = shape.staged_layer_bytes_per_token * 4 // shape.dtype_bytes
        assert term == tokens * (expected or dense), name
        if expected:
            assert expected > dense


@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_cp_replay_gathers_only_where_the_pages_fit(mode):
    """cp_replay "auto" (offload/auto.replay_schedule, which the topology and the planner both ask): the bytes a
    gathered replay holds are the whole prompt's pages, and in exact mode their gradient pages, that is what one rank
    keeps of the same prompt (measured on a real capture and run); "gathered" up to GATHER_FRACTION of the device's
    memory (GATHER_HOST_BYTES off CUDA), "spread" beyond; the plan adds them to the GPU while the replay runs."""
    from ds_longstraw.offload.auto import GATHER_FRACTION, GATHER_HOST_BYTES, gathered_bytes, replay_schedule

    prompt_len = 23
    with float64_model():
        model = tiny_qwen3_5()
        gen = torch.Generator().manual_seed(4)
        group = GRPOGroup(torch.randint(0, 97, (prompt_len,), generator=gen),
                          [torch.randint(0, 97, (3,), generator=gen)], rewards=[1.0])
        result = grpo_backward(model, group, longstraw={"prefix_grad": mode, "capture_chunk": 8, "page_tokens": 5})
    shape = shape_from_config("tiny", tiny_qwen3_5_config().to_dict(), 8)
    pages = sum(result.retained_bytes[label] for label in shape.page_bytes_per_token)
    assert gathered_bytes(shape, prompt_len, mode) == pages + result.grad_page_bytes and pages > 0
    assert (result.grad_page_bytes > 0) == (mode == "exact")

    assert replay_schedule("auto", GATHER_HOST_BYTES, None) == "gathered"
    assert replay_schedule("auto", GATHER_HOST_BYTES + 1, None) == "spread"
    assert replay_schedule("auto", int(GATHER_FRACTION * 64 * GiB), 64 * GiB) == "gathered"
    assert replay_schedule("auto", int(GATHER_FRACTION * 64 * GiB) + 1, 64 * GiB) == "spread"
    for asked in ("gathered", "spread", "replicated"):
        assert replay_schedule(asked, 1 << 50, 64 * GiB) == asked

    big = shape_from_config(*load_config("qwen3.6-27b"))
    cluster = Cluster(gpus=8, cp=8, gpus_per_node=8, gpu_memory=80 * GiB, host_memory=1024 * GiB)
    short = make_plan(big, 16 << 10, 8, mode, cluster)  # 16K: 1 GiB of pages (2 GiB exact), under 2.5 GiB
    long = make_plan(big, 64 << 10, 8, mode, cluster)  # 64K: 4 GiB (8 GiB exact), over
    assert short.replay == "gathered" and short.gathered_pages == gathered_bytes(big, 16 << 10, mode)
    assert long.replay == "spread" and long.gathered_pages == 0
    spread = make_plan(big, 16 << 10, 8, mode, cluster, cp_replay="spread")
    assert spread.replay == "spread"
    for tier in spread.needs:
        assert short.needs[tier]["gpu"] - spread.needs[tier]["gpu"] == short.gathered_pages, tier
    assert make_plan(big, 16 << 10, 8, mode, Cluster(gpus=1, cp=1, gpu_memory=80 * GiB)).replay == "one rank"
    with pytest.raises(ValueError, match="cp_replay must be"):
        make_plan(big, 16 << 10, 8, mode, cluster, cp_replay="scattered")


def test_kept_graph_line_sizes_what_capture_may_keep(capsys):
    """Exact mode on one rank: the plan says how much of the prompt's graph capture keeps (prefix_keep_graph "fits":
    KEEP_GRAPH_FRACTION of what the recommended tier leaves free on the GPU), in tokens at the family's per-token
    graph figure, the whole prompt where it fits; a family without figures says capture measures it; nothing under
    CP or in detached mode."""
    from ds_longstraw.offload.auto import KEEP_GRAPH_FRACTION
    from ds_longstraw.tools.planner import _kept_graph_line

    big = shape_from_config(*load_config("qwen3.6-27b"))
    one = Cluster(gpus=1, cp=1, gpu_memory=141 * GiB, host_memory=1024 * GiB)
    for context in (8 << 10, 128):
        plan = make_plan(big, context, 8, "exact", one)
        budget = int(KEEP_GRAPH_FRACTION * (plan.gpu_budget - plan.needs[plan.tier]["gpu"]))
        tokens = min(context - 1, budget // big.replay_graph["lora"][0])
        line = _kept_graph_line(plan)
        assert f"{tokens:,} of the prompt's {context - 1:,} tokens" in line, line
        assert ("(the whole prompt)" in line) == (tokens == context - 1)
    assert 0 < min((8 << 10) - 1, budget // big.replay_graph["lora"][0])
    glm = shape_from_config(*load_config("glm-5.2"))
    sharded = Cluster(gpus=32, cp=1, gpus_per_node=8, gpu_memory=141 * GiB, host_memory=2048 * GiB)
    assert "measures its graph" in _kept_graph_line(make_plan(glm, 4096, 8, "exact", sharded))
    assert "no tier fits" in _kept_graph_line(make_plan(glm, 4096, 8, "exact", one))
    assert main(["--model", "qwen3.6-27b", "--context", "8K", "--gpu-memory", "141GB", "--host-memory", "1TB",
                 "--prefix-grad", "exact"]) == 0
    assert "prefix_keep_graph" in capsys.readouterr().out
    for mode, cluster in (("detached", one), ("exact", Cluster(gpus=8, cp=8, gpus_per_node=8, gpu_memory=80 * GiB,
                                                               host_memory=1024 * GiB))):
        assert main(["--model", "qwen3.6-27b", "--context", "64K", "--gpu-memory", "80GB", "--host-memory", "1TB",
                     "--prefix-grad", mode, "--gpus", str(cluster.gpus)]) == 0
        assert "prefix_keep_graph" not in capsys.readouterr().out
