"""Tests for grpo_core.planning: layout rules, the memory model (against measured peaks and by hand)
and the planner's recommendations for the guide's hardware matrix."""

import pytest

from grpo_core.models import load_model_shape
from grpo_core.models.shape import ModelShape
from grpo_core.planning.layout import ParallelLayout, kv_heads_per_rank, tp_splits_kv_heads
from grpo_core.planning.memory import (
    GiB,
    MemoryOptions,
    activation_bytes_per_token_layer,
    activation_gib,
    estimate_grpo_memory,
    forward_backward_peak_gib,
    logits_gib,
    params_per_gpu,
    pinned_rounding,
    rollout_gib,
    rollout_params_per_gpu,
    training_state_gib,
)
from grpo_core.planning.planner import plan_layout, rollout_tp_fits, uneven_stages


def shape_of(name):
    return load_model_shape(name)


# ---------------------------------------------------------------- calibration against H200 peaks

# The first table of /work/shared/notes/gpu-baseline.md (H200, bf16, forward + backward, no
# optimizer step, seq 1024): (model, TP, batch, attention, measured peak GiB). Hugging Face rows ran
# SDPA attention; megatron "local spec" rows materialise the scores ("unfused").
MEASURED_PEAKS = [
    ("Qwen/Qwen2.5-1.5B", 1, 8, "sdpa", 44.2),  # Hugging Face, SDPA
    ("Qwen/Qwen2.5-1.5B", 1, 8, "unfused", 57.2),  # megatron-core, local spec
    ("Qwen/Qwen2.5-1.5B", 1, 8, "sdpa", 41.0),  # megatron-core, SDPA core attention
    ("Qwen/Qwen2.5-1.5B", 2, 8, "sdpa", 23.9),  # megatron-core, SDPA, TP=2, no SP
    ("Qwen/Qwen2.5-1.5B", 2, 8, "unfused", 32.0),  # megatron-core, local spec, TP=2, no SP
    ("Qwen/Qwen2.5-7B", 1, 4, "sdpa", 60.8),  # Hugging Face, SDPA
    ("Qwen/Qwen2.5-7B", 1, 4, "sdpa", 62.7),  # megatron-core, SDPA core attention
    ("Qwen/Qwen2.5-7B", 2, 4, "sdpa", 35.3),  # megatron-core, SDPA, TP=2, no SP
]


@pytest.mark.parametrize(("model", "tp", "batch", "attention", "measured"), MEASURED_PEAKS)
def test_forward_backward_peak_matches_measurement(model, tp, batch, attention, measured):
    estimate = forward_backward_peak_gib(shape_of(model), ParallelLayout(world_size=tp, tp=tp), batch, 1024, attention)
    assert estimate == pytest.approx(measured, rel=0.25)


def test_unfused_attention_costs_more_and_tp_halves_most():
    shape = shape_of("Qwen/Qwen2.5-1.5B")
    sdpa = forward_backward_peak_gib(shape, ParallelLayout(world_size=1), 8, 1024, "sdpa")
    unfused = forward_backward_peak_gib(shape, ParallelLayout(world_size=1), 8, 1024, "unfused")
    # The score matrices: 6 * 12 heads * 1024 bytes per token and layer, 8*1024 tokens, 28 layers
    # = 73728 * 8192 * 28 / 2**30 = 15.75 GiB
    assert unfused - sdpa == pytest.approx(73728 * 8192 * 28 / GiB)
    tp2 = forward_backward_peak_gib(shape, ParallelLayout(world_size=2, tp=2), 8, 1024, "sdpa")
    assert 0.5 * sdpa < tp2 < 0.6 * sdpa  # without sequence parallelism the norms stay replicated


# ---------------------------------------------------------------- the guide's hardware matrix


@pytest.mark.parametrize(
    ("model", "gpus", "tp", "pp"),
    [
        ("Qwen/Qwen2-7B", 4, 2, 2),
        ("Qwen/Qwen2-7B", 8, 2, 2),
        ("Qwen/Qwen2.5-32B", 16, 4, 4),
        ("meta-llama/Llama-3.1-70B", 32, 8, 4),
    ],
)
def test_dense_plans(model, gpus, tp, pp):
    shape = shape_of(model)
    plan = plan_layout(shape, gpus, gpu_gib=80)
    assert plan is not None
    assert (plan.layout.tp, plan.layout.pp) == (tp, pp)
    assert plan.layout.world_size == gpus
    assert plan.layout.dp == gpus // (tp * pp)
    assert plan.layout.ep == 1
    assert plan.estimate.offloaded == []
    assert not (plan.options.param_offload or plan.options.grad_offload or plan.options.optimizer_offload)
    _check_plan(shape, plan, gpu_gib=80)


def test_qwen3_moe_on_64_gpus():
    shape = shape_of("Qwen/Qwen3-235B-A22B")
    plan = plan_layout(shape, 64, gpu_gib=80)
    assert plan is not None
    assert plan.layout.ep > 1
    assert plan.layout.pp >= 4
    assert plan.options.optimizer_offload
    assert "optimizer" in plan.estimate.offloaded
    assert shape.num_experts % plan.layout.ep == 0
    # 94 layers do not divide by a power-of-two PP: uneven first/last stages make them fit.
    assert plan.uneven_stages == uneven_stages(94, plan.layout.pp)
    assert plan.uneven_stages != (None, None)
    text = "\n".join(plan.reasons)
    assert f"EP={plan.layout.ep}" in text and "128 experts" in text
    assert f"{plan.uneven_stages[0]} layers in the first and last stages" in text
    _check_plan(shape, plan, gpu_gib=80)


def test_model_too_big_gives_none():
    # Llama-3.1-70B on 2 x 24 GiB: bf16 weights alone are 70.55e9 * 2 / 2**30 = 131 GiB.
    assert plan_layout(shape_of("meta-llama/Llama-3.1-70B"), 2, gpu_gib=24) is None


def _check_plan(shape, plan, gpu_gib):
    assert plan.estimate.peak <= 0.9 * gpu_gib
    assert plan.layout.problems(shape, plan.uneven_stages) == []
    assert plan.micro_batch >= 1
    assert 0.1 <= plan.rollout_utilization <= 0.8
    assert plan.estimate.kv_sequences >= 8
    text = "\n".join(plan.reasons)
    layout = plan.layout
    assert f"TP={layout.tp} x PP={layout.pp}" in text
    assert f"DP={layout.dp}" in text
    assert f"{gpu_gib:g} GiB" in text
    assert f"micro-batch {plan.micro_batch}" in text
    assert f"({plan.estimate.phases['update']:.1f} GiB)" in text
    assert f"rollout TP={plan.rollout_tp}" in text


# ---------------------------------------------------------------- ParallelLayout.problems


def test_world_not_divisible_by_model_parallel():
    problems = ParallelLayout(world_size=8, tp=3).problems(shape_of("Qwen/Qwen2.5-1.5B"))
    assert any("world size 8 is not divisible by TP*PP*CP = 3*1*1 = 3" in p for p in problems)


def test_tp_may_be_a_multiple_of_the_kv_heads():
    # Qwen2.5-1.5B: 12 heads, 2 KV heads. TP=4 is a multiple of 2 (each KV head serves 2 ranks); TP=3
    # divides the heads but neither divides nor is a multiple of the KV heads.
    shape = shape_of("Qwen/Qwen2.5-1.5B")
    assert ParallelLayout(world_size=4, tp=4).problems(shape) == []
    assert ParallelLayout(world_size=3, tp=3).problems(shape) == [
        "TP=3 neither divides the 2 KV heads nor is a multiple of them: TP must be a divisor of 2 "
        "or a multiple of 2 (each KV head then serves TP/2 ranks)"
    ]
    # Qwen3-235B-A22B: 64 heads over TP=8, its 4 KV heads replicated twice (the guide's TP=8 line).
    assert ParallelLayout(world_size=64, tp=8, ep=8).problems(shape_of("Qwen/Qwen3-235B-A22B")) == []


def test_tp_splits_kv_heads_and_kv_heads_per_rank():
    assert [tp for tp in range(1, 17) if tp_splits_kv_heads(4, tp)] == [1, 2, 4, 8, 12, 16]
    # (KV heads, TP) -> heads one rank attends with: its share, or one whole head
    assert [kv_heads_per_rank(kv, tp) for kv, tp in [(8, 2), (4, 4), (4, 8), (2, 16), (1, 8)]] == [4, 1, 1, 1, 1]


def test_qkv_rows_must_split_over_tp():
    # 8 heads, 2 KV heads of width 1: (8 + 2*2) * 1 = 12 fused QKV rows cannot split over TP=8,
    # although 8 divides the heads and is a multiple of the KV heads.
    shape = ModelShape(
        model_type="llama", hidden_size=8, num_layers=2, num_attention_heads=8, num_kv_heads=2, head_dim=1,
        ffn_hidden_size=16, vocab_size=32, tie_embeddings=True, max_position_embeddings=64,
    )  # fmt: skip
    assert ParallelLayout(world_size=8, tp=8).problems(shape) == [
        "the fused QKV projection's 12 rows ((8 + 2*2) heads x 1) are not divisible by TP=8"
    ]
    assert ParallelLayout(world_size=4, tp=4).problems(shape) == []


def test_heads_not_divisible_by_tp():
    # SmolLM2-135M: 9 heads, 3 KV groups; TP=2 divides neither.
    problems = ParallelLayout(world_size=2, tp=2).problems(shape_of("HuggingFaceTB/SmolLM2-135M"))
    assert "attention heads (9) are not divisible by TP=2: TP must divide 9" in problems
    assert any(p.startswith("TP=2 neither divides the 3 KV heads") for p in problems)


def test_good_layout_has_no_problems():
    assert ParallelLayout(world_size=8, tp=2, pp=2).problems(shape_of("Qwen/Qwen2.5-1.5B")) == []


def test_layers_not_divisible_by_pp_and_the_uneven_fix():
    shape = shape_of("Qwen/Qwen2.5-1.5B")
    layout = ParallelLayout(world_size=3, pp=3)
    problems = layout.problems(shape)  # 28 % 3 = 1
    assert len(problems) == 1
    assert "layers (28) are not divisible by PP=3" in problems[0]
    assert "num_layers_in_first_pipeline_stage" in problems[0]
    # first 10 + last 10 leaves 28 - 20 = 8 layers for the 1 middle stage: fine.
    assert layout.problems(shape, (10, 10)) == []
    # uneven_stages picks 9 + 9, leaving 10 for the middle stage.
    assert uneven_stages(28, 3) == (9, 9)
    assert layout.problems(shape, uneven_stages(28, 3)) == []


def test_uneven_stages_that_do_not_divide():
    shape = shape_of("Qwen/Qwen2.5-1.5B")
    layout = ParallelLayout(world_size=5, pp=5)
    # 5 + 5 leaves 18 for 3 middle stages (6 each): fine; 4 + 5 leaves 19: not divisible by 3.
    assert layout.problems(shape, (5, 5)) == []
    problems = layout.problems(shape, (4, 5))
    assert len(problems) == 1
    assert "left after the uneven first/last stages (19)" in problems[0]
    assert "PP=3" in problems[0]


def test_ep_on_a_dense_model():
    problems = ParallelLayout(world_size=2, ep=2).problems(shape_of("Qwen/Qwen2.5-1.5B"))
    assert problems == ["expert parallelism (EP=2, ETP=1) needs an MoE model; this one is dense"]


def test_ep_must_divide_experts():
    problems = ParallelLayout(world_size=3, ep=3).problems(shape_of("Qwen/Qwen3-235B-A22B"))
    assert problems == ["128 experts are not divisible by EP=3"]
    assert ParallelLayout(world_size=8, ep=8).problems(shape_of("Qwen/Qwen3-235B-A22B")) == []


def test_dp_and_expert_dp():
    layout = ParallelLayout(world_size=64, tp=2, pp=8, ep=8)
    assert layout.model_parallel == 16  # 2 * 8 * 1
    assert layout.dp == 4  # 64 / 16
    assert layout.expert_dp == 1  # 64 / (ETP 1 * EP 8 * PP 8)
    layout = ParallelLayout(world_size=32, tp=2, pp=2, ep=4)
    assert layout.dp == 8  # 32 / (2*2)
    assert layout.expert_dp == 4  # 32 / (1*4*2)
    layout = ParallelLayout(world_size=16, tp=2, cp=2, ep=2, etp=2)
    assert layout.dp == 4  # 16 / (2*1*2)
    assert layout.expert_dp == 4  # 16 / (2*2*1): CP does not split the experts
    assert "DP=4 EP=2 ETP=2 expert-DP=4" in layout.describe()


# ---------------------------------------------------------------- memory arithmetic by hand

# Qwen2.5-0.5B: h=896, 24 layers, 14 heads, 2 KV heads (head_dim 64), ffn 4864, vocab 151936, tied.
#   attention per layer: 896*(896+256) + 896*896 + bias (896+256) + norms 2*896
#                      = 1,032,192 + 802,816 + 1,152 + 1,792 = 1,837,952
#   MLP per layer: 3*896*4864 = 13,074,432                     -> 14,912,384 per layer
#   24 layers = 357,897,216; embedding (tied, counted once) 151936*896 = 136,134,656
#   -> 494,031,872 (+ the final norm's 896 = 494,032,768, the published total)
P_05B = 24 * 14_912_384 + 151_936 * 896


def test_params_per_gpu_by_hand():
    shape = shape_of("Qwen/Qwen2.5-0.5B")
    assert P_05B == 494_031_872
    dense, expert = params_per_gpu(shape, ParallelLayout(world_size=1))
    assert expert == 0
    # The final norm (896) may or may not be counted; a second vocab matrix (136M) must not be.
    assert dense == pytest.approx(P_05B, abs=shape.hidden_size)
    # TP=2 halves it.
    dense_tp2, _ = params_per_gpu(shape, ParallelLayout(world_size=2, tp=2))
    assert dense_tp2 == pytest.approx(dense / 2)


def test_params_per_gpu_untied_and_pipelined():
    # Llama-3.1-8B: untied, so PP=1 holds 2 vocab matrices; a PP=4 stage holds 8 layers + 1.
    shape = shape_of("meta-llama/Llama-3.1-8B")
    vocab = 128256 * 4096
    per_layer = (shape.num_params - 2 * vocab - 4096) / 32
    dense, _ = params_per_gpu(shape, ParallelLayout(world_size=1))
    assert dense == pytest.approx(32 * per_layer + 2 * vocab)
    dense_pp4, _ = params_per_gpu(shape, ParallelLayout(world_size=4, pp=4))
    assert dense_pp4 == pytest.approx(8 * per_layer + vocab)


def test_training_state_by_hand():
    shape = shape_of("Qwen/Qwen2.5-0.5B")
    opts = MemoryOptions(dtype="bfloat16", use_distributed_optimizer=True)
    params = sum(params_per_gpu(shape, ParallelLayout(world_size=1)))
    weights, grads, optimizer = training_state_gib(shape, ParallelLayout(world_size=1), opts)
    # bf16 weights 2 B, fp32 grads 4 B, Adam 8 B + fp32 master 4 B = 12 B per parameter
    assert weights == pytest.approx(params * 2 / 2**30)  # ~0.92 GiB
    assert grads == pytest.approx(params * 4 / 2**30)
    assert optimizer == pytest.approx(params * 12 / 2**30)  # ~5.52 GiB
    assert optimizer == pytest.approx(P_05B * 12 / 2**30, rel=1e-5)

    # megatron's hybrid optimizer: the Adam states go to the host, the fp32 master copy stays on the GPU
    offloaded = training_state_gib(shape, ParallelLayout(world_size=1), MemoryOptions(optimizer_offload=True))
    assert offloaded == pytest.approx((weights, grads, params * 4 / 2**30))
    three_quarters = training_state_gib(shape, ParallelLayout(world_size=1), MemoryOptions(optimizer_offload=0.75))
    assert three_quarters[2] == pytest.approx(params * (4 + 8 / 4) / 2**30)

    # DP=4 with the distributed optimizer: each rank keeps a quarter of the optimizer state.
    dp4 = training_state_gib(shape, ParallelLayout(world_size=4), opts)
    assert dp4 == pytest.approx((weights, grads, optimizer / 4))
    # ... but not without it, nor when sharding is switched off for planning.
    no_dist = MemoryOptions(use_distributed_optimizer=False)
    assert training_state_gib(shape, ParallelLayout(world_size=4), no_dist)[2] == pytest.approx(optimizer)
    unsharded = training_state_gib(shape, ParallelLayout(world_size=4), opts, shard_optimizer=False)
    assert unsharded[2] == pytest.approx(optimizer)
    # fp32 training: 4 B weights and no separate master copy (8 B optimizer).
    fp32 = training_state_gib(shape, ParallelLayout(world_size=1), MemoryOptions(dtype="float32"))
    assert fp32 == pytest.approx((params * 4 / 2**30, params * 4 / 2**30, params * 8 / 2**30))


def test_activations_and_logits_by_hand():
    shape = shape_of("Qwen/Qwen2.5-0.5B")
    layout = ParallelLayout(world_size=1)
    # Per token and layer (sdpa, TP=1): replicated 8h = 7168; split 2*(4h + 4kv + 3f)
    #   = 2*(3584 + 512 + 14592) = 37,376; total 44,544 bytes.
    # micro-batch 2 x 1024 = 2048 tokens, 24 layers: 44544*2048*24 = 2,189,426,688 B = 2.0390625 GiB
    assert activation_gib(shape, layout, 2, 1024, MemoryOptions()) == pytest.approx(2.0390625)
    # Unfused adds 6 * 14 heads * 1024 = 86,016 B per token and layer: *2048*24 / 2**30 = 3.9375 GiB
    unfused = activation_gib(shape, layout, 2, 1024, MemoryOptions(attention="unfused"))
    assert unfused == pytest.approx(2.0390625 + 3.9375)
    # Logits: 2048 tokens * 151936 vocab * 6 B = 1,866,989,568 B
    assert logits_gib(shape, layout, 2, 1024) == pytest.approx(1_866_989_568 / 2**30)


def test_tp_above_the_kv_heads_by_hand():
    # Qwen2.5-1.5B (h=1536, 12 heads, 2 KV heads of 128, f=8960, 28 layers, QKV bias) at TP=4.
    shape = shape_of("Qwen/Qwen2.5-1.5B")
    tp4 = ParallelLayout(world_size=4, tp=4)
    # megatron splits the fused QKV rows evenly ((12 + 2*2) * 128 / 4 = 512 per rank): no replicas, so
    # the weights per GPU are a quarter, as at TP=2 they are a half.
    dense, _ = params_per_gpu(shape, ParallelLayout(world_size=1))
    assert params_per_gpu(shape, tp4)[0] == pytest.approx(dense / 4)
    # Activations per token and layer (sdpa, sequence parallel): 8h/4 = 3072 replicated-by-SP,
    # 2*(4h + 3f)/4 = 2*(6144 + 26880)/4 = 16,512, and k/v of one whole KV head 2*4*128 = 1024
    # (a 2/4-head share, 512, would be wrong): 20,608 B.
    assert activation_bytes_per_token_layer(shape, tp4, 1024, MemoryOptions()) == 20_608
    # At TP=2 the KV term is the share: 2*4*(2/2 * 128) = 1024 too, the rest halves: 6144 + 33,024 + 1024.
    assert activation_bytes_per_token_layer(shape, ParallelLayout(world_size=2, tp=2), 1024, MemoryOptions()) == (
        40_192
    )


def test_rollout_replicates_kv_heads_by_hand():
    shape = shape_of("Qwen/Qwen2.5-1.5B")
    # vLLM at TP=4 keeps one whole KV head per rank: 4 heads stored where there are 2, so 2 replicas per
    # layer of K and V projections with bias: 2 * 2*128*(1536 + 1) = 786,944 params, 28 layers = 22,034,432.
    assert rollout_params_per_gpu(shape, 4) == (shape.num_params + 22_034_432) / 4
    assert rollout_params_per_gpu(shape, 2) == shape.num_params / 2
    # its KV cache per token: 2 (K, V) * 28 layers * 1 head * 128 * 2 B = 14,336 B; 1024 sequences of 1024 tokens
    weights, cache, sequences = rollout_gib(shape, 4, "bfloat16", 1024, 80, 0.5, static_sequences=1024)
    assert cache == pytest.approx(1024 * 1024 * 14_336 / 2**30)  # 14 GiB
    assert weights == pytest.approx((shape.num_params + 22_034_432) / 4 * 2 / 2**30)
    assert rollout_tp_fits(shape, 4) and not rollout_tp_fits(shape, 3)


def test_grpo_phases():
    shape = shape_of("Qwen/Qwen2.5-0.5B")
    layout = ParallelLayout(world_size=1)
    est = estimate_grpo_memory(shape, layout, MemoryOptions(), 2, 1024, gpu_gib=80, rollout_utilization=0.5)
    w, g, o = training_state_gib(shape, layout, MemoryOptions())
    assert (est.weights, est.gradients, est.optimizer) == pytest.approx((w, g, o))
    assert est.reference == pytest.approx(w)  # the reference model: a second copy of the weights
    assert est.activations == pytest.approx(2.0390625)
    assert est.logits == pytest.approx(1_866_989_568 / 2**30)
    # free_cache_engine=True: the rollout engine sleeps during the update.
    update = w + g + o + w + 2.0390625 + 1_866_989_568 / 2**30
    assert est.phases["update"] == pytest.approx(update)
    # Generation: the resident training state, the reference and 80 * 0.5 = 40 GiB of rollout engine.
    assert est.phases["generation"] == pytest.approx(w + g + o + w + 40.0)
    assert est.peak == max(est.phases.values())
    assert est.peak_phase == "generation"

    # Keeping the engine awake adds its 40 GiB to the update.
    awake = estimate_grpo_memory(
        shape, layout, MemoryOptions(), 2, 1024, gpu_gib=80, rollout_utilization=0.5, free_cache_engine=False
    )
    assert awake.phases["update"] == pytest.approx(update + 40.0)

    # Parameter offload frees the weights during generation, not during the update.
    offload = estimate_grpo_memory(
        shape, layout, MemoryOptions(param_offload=True), 2, 1024, gpu_gib=80, rollout_utilization=0.5
    )
    assert offload.phases["generation"] == pytest.approx(est.phases["generation"] - w)
    assert offload.phases["update"] == pytest.approx(est.phases["update"])
    assert offload.offloaded == ["parameters"]

    # No reference model: one weight copy less everywhere.
    no_ref = estimate_grpo_memory(
        shape, layout, MemoryOptions(), 2, 1024, gpu_gib=80, rollout_utilization=0.5, with_reference=False
    )
    assert no_ref.phases["update"] == pytest.approx(update - w)
    assert no_ref.phases["generation"] == pytest.approx(est.phases["generation"] - w)

    # The static engine: its own bf16 weights (0.49B params * 2 B) plus exactly max_num_seqs full-length
    # sequences of KV cache (2 * 24 layers * 2 KV heads * 64 * 2 B = 12,288 B per token); asleep it keeps
    # the weights and frees the cache.
    static = estimate_grpo_memory(shape, layout, MemoryOptions(), 2, 1024, gpu_gib=80, static_sequences=64)
    weights = shape.num_params * 2 / 2**30
    assert static.kv_cache == pytest.approx(64 * 1024 * 12_288 / 2**30)  # 0.75 GiB
    assert static.phases["generation"] == pytest.approx(w + g + o + w + weights + 0.75)
    assert static.phases["update"] == pytest.approx(update + weights)


# ---------------------------------------------------------------- uneven stages


def test_uneven_stages():
    assert uneven_stages(94, 8) == (11, 11)  # 94 - 2*11 = 72, 72 / 6 middle stages = 12
    assert uneven_stages(28, 4) == (None, None)  # 28 / 4 = 7: even already
    assert uneven_stages(29, 2) == (None, None)  # no middle stage to even out
    assert uneven_stages(94, 4) == (23, 23)  # 94 - 46 = 48, 48 / 2 = 24


def test_embedding_and_loss_counted_as_layers_in_the_pipeline_split():
    # verl's Qwen3-235B-A22B script: 94 layers, PP=8, account_for_{embedding,loss}_in_pipeline_split: (94 + 2) / 8
    shape = shape_of("Qwen/Qwen3-235B-A22B")
    layout = ParallelLayout(world_size=32, tp=4, pp=8, ep=4)
    assert "layers (94) are not divisible by PP=8" in layout.problems(shape)[0]
    assert layout.problems(shape, pipeline_extra_layers=2) == []
    one = layout.problems(shape, pipeline_extra_layers=1)  # 95 % 8
    assert one and "layers (with the embedding/loss counted as layers) (95)" in one[0]
    assert "cannot be combined" in layout.problems(shape, (11, 11), pipeline_extra_layers=2)[0]


def test_pinned_rounding_by_hand():
    """h=4 (2 heads of 2, 1 KV head), f=6, vocab 16, one layer, untied; fp32 bytes per tensor: embedding and
    output 256 each, QKV 4x8x4=128, o 64, norms 16 x3, fc1 2x6x4x4=192 -> 256, fc2 96 -> 128: 1136 / 1040."""
    shape = ModelShape("llama", 4, 1, 2, 1, 2, 6, 16, False, 64)
    assert pinned_rounding(shape, ParallelLayout(world_size=1)) == pytest.approx(1136 / 1040)
    # split over 3 shards: 85.3 -> 128 twice, 42.7 -> 64, 21.3 -> 32, 5.3 -> 8 x3, 64, 32: 472 / (1040 / 3)
    assert pinned_rounding(shape, ParallelLayout(world_size=3), shards=3) == pytest.approx(472 * 3 / 1040)
    # Qwen2.5-7B's fp32 tensors on one GPU: megatron's CPU optimizer pins ~1.89x their bytes
    assert pinned_rounding(shape_of("Qwen/Qwen2.5-7B"), ParallelLayout(world_size=1)) == pytest.approx(1.886, abs=1e-3)


def test_lora_keeps_no_gradients_optimizer_state_or_reference_for_the_base():
    """LoRA rank 64 on Qwen2.5-7B: bf16 base + adapters, fp32 gradients and 12 B of optimizer state per adapter
    parameter only, no reference weights; the planner then fits it on one 80 GB GPU without offload, where full
    training does not fit there without it."""
    from grpo_core.planning.memory import lora_params_per_gpu

    shape, one, rank = shape_of("Qwen/Qwen2.5-7B"), ParallelLayout(world_size=1), 64
    h, ffn, layers = shape.hidden_size, shape.ffn_hidden_size, shape.num_layers
    qkv = (shape.num_attention_heads + 2 * shape.num_kv_heads) * shape.head_dim
    attn = shape.num_attention_heads * shape.head_dim
    adapters = layers * rank * ((h + qkv) + (attn + h) + (h + 2 * ffn) + (ffn + h))
    assert lora_params_per_gpu(shape, one, rank) == pytest.approx(adapters)  # ~40M
    opts = MemoryOptions(dtype="bfloat16", lora_rank=rank)
    weights, grads, optimizer = training_state_gib(shape, one, opts)
    assert weights == pytest.approx((sum(params_per_gpu(shape, one)) + adapters) * 2 / GiB)
    assert (grads, optimizer) == pytest.approx((adapters * 4 / GiB, adapters * 12 / GiB))
    estimate = estimate_grpo_memory(shape, one, opts, micro_batch=4, seq_len=2048, gpu_gib=80)
    assert estimate.reference == 0  # the reference is the base: the actor with its adapters off
    lora_plan, full_plan = plan_layout(shape, 1, 80, lora_rank=rank), plan_layout(shape, 1, 80)
    assert lora_plan is not None and lora_plan.estimate.offloaded == []
    assert full_plan is None or full_plan.estimate.offloaded
