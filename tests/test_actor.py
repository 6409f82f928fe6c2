"""The Megatron actor on CPU (torchrun + gloo): one GRPO update gives the same loss, grad norm and log-probs for TP1,
TP2, PP2, DP2 (distributed optimizer), TP2 x PP2 and CP2 (alone, with TP2, with PP2), padded or packed, by rows or
by a token budget, and so do the GRPO family's updates (GSPO, rollout IS, RLOO's and REINFORCE++'s advantages); for
every loss aggregation mode the update does not depend on the micro-batching (rows or a token budget) or on DP; and
a few updates move the log-probs of positive-advantage responses up and of negative ones down."""

import inspect
import json

import pytest
import torch

from grpo_core.algos import LOSS_AGG_MODES
from tests.dist.launch import torchrun


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
    )
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def actor_out(tmp_path_factory):
    return tmp_path_factory.mktemp("actor")


@pytest.fixture(scope="module")
def layouts(tiny_llama, actor_out):
    out = actor_out
    results = {}
    launches = [  # the DP1 and DP2 launches also run the aggregation x micro-batching sweep (sweep_dp*.json)
        (1, "1,1;1,1,h;1,1,t;1,1,pt", ["--learn-steps", "4", "--sweep-out", str(out / "sweep_dp1.json")]),
        (2, "2,1;1,2;1,1;1,1,r;2,1,pf;1,1,pt;1,1,c", ["--sweep-out", str(out / "sweep_dp2.json")]),
        (4, "2,2;2,2,pt;2,1,c;1,2,ct", []),
    ]
    for nproc, spec, extra in launches:
        path = out / f"r{nproc}.json"
        args = ("--hf-dir", str(tiny_llama), "--layouts", spec, "--out", str(path), "--family", *extra)
        torchrun("actor_worker.py", nproc, *args)
        results.update(json.loads(path.read_text()))
    return results


def test_every_layout_gives_the_same_update(layouts):
    exact = {"tp1_pp1_dp1", "tp2_pp1_dp1", "tp1_pp2_dp1", "tp1_pp1_dp2", "tp2_pp2_dp1", "tp1_pp1_dp2_r"}
    # packed sequences (TP2; PP2, whose micro-batches share one packed length) and
    # token-budget micro-batches (DP2: a different number of micro-batches on each rank)
    exact |= {"tp1_pp1_dp1_t", "tp1_pp1_dp1_pt", "tp2_pp1_dp1_pf", "tp1_pp1_dp2_pt", "tp2_pp2_dp1_pt"}
    # context parallelism (CP2 alone, with TP2, with PP2): the keys and values gathered, the log-probs too
    # (with PP2 by a token budget: unpacked, so one number of whole rows per micro-batch, actor.rows_in_budget)
    exact |= {"tp1_pp1_dp1_c", "tp2_pp1_dp1_c", "tp1_pp2_dp1_ct"}
    assert set(layouts) == exact | {"tp1_pp1_dp1_h"}
    ref = layouts["tp1_pp1_dp1"]
    real = torch.tensor(ref["response_mask"]).bool()  # log-probs past a response's end are never used
    for name in exact:  # fp32, activation recomputation included
        result = layouts[name]
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac"):
            assert result["metrics"][key] == pytest.approx(ref["metrics"][key], abs=1e-5), (name, key)
        log_probs = torch.tensor(result["log_probs"])[real]
        assert torch.allclose(log_probs, torch.tensor(ref["log_probs"])[real], atol=1e-5), name
    assert ref["metrics"]["actor/grad_norm"] > 0
    # the fused QKV split ran in the layout that turned it on, and in no other
    assert {name for name, result in layouts.items() if result["split_rope_calls"]} == {"tp2_pp1_dp1_pf"}
    assert 0 < ref["metrics"]["actor/pg_clipfrac"] < 1  # the synthetic old log-probs exercise clipping


FAMILY_LAYOUTS = ("tp2_pp1_dp1", "tp1_pp2_dp1", "tp1_pp1_dp2", "tp2_pp2_dp1")  # the plain fp32 layouts but TP1


@pytest.mark.parametrize("case", ["gspo", "is-token", "is-sequence", "rloo", "reinforce_plus_plus"])
def test_the_family_updates_are_the_same_at_every_layout(layouts, case):
    """Issue 16: GSPO, rollout importance sampling by token and by sequence, and RLOO's and REINFORCE++'s
    advantages give TP1's update at TP2, PP2, DP2 and TP2 x PP2 (fp32, 1e-5), each from the initial weights, in the
    launches of the layout test; and each is its own update, not the plain one's."""
    ref = layouts["tp1_pp1_dp1"]["family"][case]
    assert ref["actor/grad_norm"] > 0
    assert ref["actor/grad_norm"] != pytest.approx(layouts["tp1_pp1_dp1"]["metrics"]["actor/grad_norm"], rel=1e-3)
    for name in FAMILY_LAYOUTS:
        got = layouts[name]["family"][case]
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac"):
            assert got[key] == pytest.approx(ref[key], abs=1e-5), (name, key)


def test_an_on_policy_update_is_the_update_after_a_separate_log_prob_pass(layouts):
    """With one epoch of one mini-batch the update's own forward gives the old log-probs: the same update (fp32,
    1e-5) and log-probs as a separate pass before it, at every plain layout; the ratio is exactly 1 (no clipping)."""
    for name in ("tp1_pp1_dp1", *FAMILY_LAYOUTS):
        on_policy = layouts[name]["family"]["on_policy"]
        separate, fused = on_policy["separate"], on_policy["fused"]
        assert separate["actor/grad_norm"] > 0
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl"):
            assert fused[key] == pytest.approx(separate[key], abs=1e-5), (name, key)
        assert fused["actor/pg_clipfrac"] == 0
        assert on_policy["log_prob_diff"] < 1e-5, name


def test_the_first_mini_batch_gives_its_own_old_log_probs(layouts):
    """Two mini-batches: a pass over the second one's rows only, the first's log-probs from its own forward, is
    the same update (fp32, 1e-5) as a pass over every row first, at every plain layout; misaligned later rows
    would show in the ratio's KL."""
    for name in ("tp1_pp1_dp1", *FAMILY_LAYOUTS):
        result = layouts[name]["family"]["first_on_policy"]
        separate, fused = result["separate"], result["fused"]
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl"):
            assert fused[key] == pytest.approx(separate[key], abs=1e-5), (name, key)
        assert separate["actor/ppo_kl"] != pytest.approx(0, abs=1e-7), name  # the second mini-batch moved
        assert result["log_prob_diff"] < 1e-5, name
        assert result["rows"] == [8, 8], name


def test_family_cases_are_the_workers():
    from tests.dist.actor_worker import FAMILY_CASES

    assert FAMILY_CASES == ("gspo", "is-token", "is-sequence", "rloo", "reinforce_plus_plus")


@pytest.fixture(scope="module")
def sweeps(layouts, actor_out):
    return {dp: json.loads((actor_out / f"sweep_dp{dp}.json").read_text()) for dp in (1, 2)}


SWEEP_METRICS = ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm")


SWEEP_CASES = (  # tests.dist.actor_worker.SWEEP_CASES
    *LOSS_AGG_MODES, "gspo", "is-token", "is-sequence", "sapo", "cispo", "geo_mean", "dppo_tv"
)  # fmt: skip


@pytest.mark.parametrize("mode", SWEEP_CASES)
def test_the_update_does_not_depend_on_micro_batching_or_dp(sweeps, mode):
    """Issue 15: one update at micro-batches of 2, 4 and 8 rows or their token budgets, at DP1 and DP2, gives one
    loss and grad norm in every aggregation mode (fp32: to 1e-5). Issue 16: so do GSPO (one ratio per sequence:
    every row whole in one micro-batch) and rollout importance sampling by token and by sequence. Issue 43: so do
    SAPO, CISPO, GMPO (geo_mean) and DPPO-TV."""
    from tests.dist.actor_worker import sweep_micro_batching

    names = [name for name, _, _ in sweep_micro_batching()]
    ref = sweeps[1]["updates"][f"{mode}/8"]
    assert ref["actor/grad_norm"] > 0
    for dp, sweep in sweeps.items():
        for name in names:
            got = sweep["updates"][f"{mode}/{name}"]
            for key in SWEEP_METRICS:
                assert got[key] == pytest.approx(ref[key], abs=1e-5), (dp, name, key)


def test_dr_grpo_is_the_token_sum_mean_over_the_constant(sweeps):
    """With every response's token sum divided by one constant C=8, Dr.GRPO's update is seq-mean-token-sum's / 8."""
    norm, plain = sweeps[1]["updates"]["seq-mean-token-sum-norm/8"], sweeps[1]["updates"]["seq-mean-token-sum/8"]
    for key in SWEEP_METRICS:
        assert norm[key] == pytest.approx(plain[key] / 8, rel=1e-5), key


def test_log_probs_by_a_token_budget_equal_those_by_rows(sweeps):
    real = torch.tensor(sweeps[1]["response_mask"]).bool()  # log-probs past a response's end are never used
    ref = torch.tensor(sweeps[1]["log_probs"]["8"])[real]
    for dp, sweep in sweeps.items():
        assert len(sweep["log_probs"]) == 6
        for name, log_probs in sweep["log_probs"].items():
            assert torch.allclose(torch.tensor(log_probs)[real], ref, atol=1e-5), (dp, name)
        # the sweep put the weights back after every update: each combination started from the same ones
        assert torch.allclose(torch.tensor(sweep["restored"])[real], ref, atol=1e-5), dp


def test_the_family_variants_change_the_update(sweeps):
    """GSPO and the importance weights are not silently the plain loss: their updates differ from token-mean's
    (GSPO's from seq-mean-token-mean's, the aggregation it uses), and GSPO clips some sequences but not all."""
    updates = sweeps[1]["updates"]
    plain = {"gspo": "seq-mean-token-mean", "is-token": "token-mean", "is-sequence": "token-mean"}
    for case, base in plain.items():
        assert updates[f"{case}/8"]["actor/grad_norm"] != pytest.approx(
            updates[f"{base}/8"]["actor/grad_norm"], rel=1e-3
        )
    assert 0 < updates["gspo/8"]["actor/pg_clipfrac"] < 1


def test_sweep_cases_are_the_workers():
    from tests.dist.actor_worker import SWEEP_CASES as worker_cases

    assert worker_cases == SWEEP_CASES


@pytest.mark.parametrize("mode", SWEEP_CASES)
def test_the_update_gradient_is_autograd_of_the_grpo_loss_on_the_hf_model(sweeps, tiny_llama, mode):
    """The actor divides each micro-batch's loss sum by the whole mini-batch's denominator (tokens or non-empty
    rows) before the backward; its gradient norm must be that of the same GRPO loss, in each aggregation mode,
    differentiated through the HF model."""
    from transformers import AutoModelForCausalLM

    from grpo_core.actor.loss import grpo_loss
    from grpo_core.models.shape import load_model_shape
    from tests.dist.actor_worker import sweep_loss, synthetic_batch, with_old_and_ref

    ref = sweeps[1]["updates"][f"{mode}/8"]
    batch = synthetic_batch(load_model_shape(tiny_llama).vocab_size)
    batch = with_old_and_ref(batch, torch.tensor(sweeps[1]["log_probs"]["8"]))
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32, attn_implementation="eager")
    logits = model(batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids).logits
    total, r = batch.input_ids.shape[1], batch.response_length
    log_p = logits[:, total - r - 1 : total - 1].log_softmax(-1)
    lp = log_p.gather(-1, batch.responses.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    loss_sum, denominator, _ = grpo_loss(
        lp,
        entropy,
        batch.old_log_probs,
        batch.advantages,
        batch.response_mask,
        batch.ref_log_probs,
        sweep_loss(mode),
        batch.rollout_log_probs,
    )
    (loss_sum / denominator).backward()
    grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()
    assert ref["actor/grad_norm"] == pytest.approx(grad_norm, rel=1e-4)


def test_fp16_with_loss_scaling_matches_fp32_to_its_precision(layouts):
    ref, half = layouts["tp1_pp1_dp1"]["metrics"], layouts["tp1_pp1_dp1_h"]["metrics"]
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy"):
        assert half[key] == pytest.approx(ref[key], abs=2e-2), key
    assert half["actor/grad_norm"] == pytest.approx(ref["actor/grad_norm"], rel=0.05)  # unscaled by the scaler


def test_updates_move_log_probs_with_the_advantage(layouts):
    result = layouts["tp1_pp1_dp1"]
    before, after = torch.tensor(result["log_probs"]), torch.tensor(result["log_probs_after"])
    mask = torch.tensor(result["response_mask"])
    positive = torch.arange(before.shape[0]) % 2 == 0  # the worker gives even rows advantage +1, odd rows -1
    change = ((after - before) * mask).sum(-1)
    assert (change[positive] > 0).all(), change
    assert (change[~positive] < 0).all(), change


def test_reference_is_frozen_and_offloadable(layouts):
    for name, result in layouts.items():
        # same weights, and the update did not touch them
        assert result["ref_change"] < 1e-6 < 1e-4 < result["policy_change"], name
        assert result["ref_offloaded_bytes"] > 0 and result["actor_offloaded_bytes"] > result["ref_offloaded_bytes"]
        # offloaded a second time (its first host copy reused) and brought back: the same log-probs
        assert result["ref_offloaded_again"] == result["ref_offloaded_bytes"] and result["ref_again_change"] < 1e-6


@pytest.mark.parametrize("frozen", [False, True])
def test_host_offloader_frees_and_restores_storage(frozen):
    """Views stay valid across offload/reload; a frozen offloader copies once and reuses that copy (a change made
    on the device in between is not copied: frozen tensors do not change), the other copies every time."""
    from grpo_core.actor.offload import HostOffloader

    flat = torch.arange(8, dtype=torch.float32)
    views = [flat[:4], flat[4:]]
    host = HostOffloader(frozen=frozen)
    assert host.offload(views) == 32 and flat.untyped_storage().size() == 0 and host.offloaded
    assert host.offload(views) == 0  # already offloaded
    assert host.reload() == 32 and torch.equal(views[1], torch.arange(4.0, 8.0))
    flat[0] = 100.0
    assert host.offload(views) == 32 and host.reload() == 32
    assert views[0][0].item() == (0.0 if frozen else 100.0)
    assert host.reload() == 0  # nothing offloaded


SETTINGS_SNIPPET = """
import dataclasses, json, sys
from grpo_core.actor.actor import ActorSettings
from grpo_core.config import load_config
from grpo_core.planning.layout import actor_layout
cfg = load_config(sys.argv[1], sys.argv[2:])
s = ActorSettings.from_config(cfg, actor_layout(cfg), total_optimizer_steps=200)
print(json.dumps({k: v for k, v in dataclasses.asdict(s).items() if k != "layout"}))
"""


def test_settings_come_from_verl_keys():
    """The config -> actor mapping, in a subprocess (megatron and the CPU layer stay out of pytest)."""
    import subprocess
    import sys

    from tests.conftest import REPO

    overrides = [
        "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1",
        "actor_rollout_ref.actor.kl_coeff=0.02",
        "+actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_offload_fraction=0.5",
        "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
        "algorithm.rollout_correction.rollout_is=sequence",
        "algorithm.rollout_correction.rollout_is_threshold=3",
    ]
    proc = subprocess.run(
        [sys.executable, "-c", SETTINGS_SNIPPET, str(REPO / "configs" / "grpo_advanced.yaml"), *overrides],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(proc.stdout.strip().splitlines()[-1])
    assert s["mini_batch_rows"] == 128 * 8  # ppo_mini_batch_size x rollout.n: responses per optimizer step
    assert s["micro_batch_rows"] == 2
    assert s["lr_warmup_steps"] == 20  # 10% of 200 optimizer steps (lr_warmup_steps=-1 defers to the ratio)
    assert s["lr_decay_style"] == "cosine" and s["dtype"] == "bfloat16" and s["optimizer_offload"] is True
    assert s["recompute"] is False  # the YAML sets recompute_granularity itself, via override_transformer_config
    assert s["transformer_overrides"]["recompute_granularity"] == "full"
    assert s["loss"]["kl_loss_coef"] == 0.02 and s["loss"]["clip_ratio_high"] == 0.28
    assert s["loss"]["loss_scale_factor"] == 2048  # Dr.GRPO's constant: data.max_response_length unless set
    assert s["optimizer_overrides"] == {"optimizer_offload_fraction": 0.5}
    assert s["loss"]["loss_mode"] == "gspo"
    assert s["loss"]["rollout_is"] == "sequence" and s["loss"]["rollout_is_threshold"] == 3.0


def test_log_prob_passes_take_rows_or_their_token_budget():
    from types import SimpleNamespace

    from grpo_core.trainer.loop import log_prob_batching

    rows = SimpleNamespace(log_prob_micro_batch_size_per_gpu=8, log_prob_use_dynamic_bsz=False,
                           log_prob_max_token_len_per_gpu=4096)  # fmt: skip
    assert log_prob_batching(rows) == {"micro_batch_rows": 8, "micro_batch_tokens": None}
    rows.log_prob_use_dynamic_bsz = True
    assert log_prob_batching(rows) == {"micro_batch_rows": 8, "micro_batch_tokens": 4096}


def test_optimizer_overrides_come_after_the_offload_shorthand():
    from grpo_core.actor.training import optimizer_fields

    whole = {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.0}
    assert optimizer_fields(True, None, cuda=True) == whole
    assert optimizer_fields(False, {"lr": 1e-5}, cuda=True) == {"lr": 1e-5}
    half = {"optimizer_offload_fraction": 0.5, "overlap_cpu_optimizer_d2h_h2d": True}
    assert optimizer_fields(True, half, cuda=True) == {"optimizer_cpu_offload": True, **half}
    # a CPU holds the states in host memory already; megatron's GPU/CPU hybrid step cannot run there
    assert optimizer_fields(True, half, cuda=False) == {"optimizer_cpu_offload": False, **half}
    assert optimizer_fields(False, {"optimizer_cpu_offload": True}, cuda=False) == {"optimizer_cpu_offload": False}


@pytest.mark.parametrize("vocab_size", [50, 47], ids=["full", "padded"])
def test_log_probs_and_entropy_match_autograd_reference(vocab_size, monkeypatch):
    """Values and gradients (log-prob and entropy terms) against log_softmax, on one rank, whole and in CPU passes
    of a few rows; columns past ``vocab_size`` (TP padding) must count for nothing."""
    from megatron.core import parallel_state as ps

    from grpo_core.actor import logprobs
    from grpo_core.actor.logprobs import log_probs_and_entropy
    from grpo_core.actor.parallel import init_distributed, init_model_parallel, shutdown_distributed
    from grpo_core.planning.layout import ParallelLayout

    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):  # restored afterwards: later subprocesses
        monkeypatch.setenv(key, "")  # must not inherit this process's rendezvous
        monkeypatch.delenv(key)
    init_distributed()  # one process: a loopback gloo group, TP = 1
    init_model_parallel(ParallelLayout(world_size=1), seed=0)
    try:
        _check_log_probs_against_reference(log_probs_and_entropy, vocab_size)
        monkeypatch.setattr(logprobs, "CPU_ROWS", 4)  # 15 tokens in CPU passes of 4, 4, 4 and 3 rows
        _check_log_probs_against_reference(log_probs_and_entropy, vocab_size)
    finally:
        shutdown_distributed()  # what a rank does before it exits; the next parameter starts both again
    assert not torch.distributed.is_initialized() and not ps.model_parallel_is_initialized()


def test_softmax_sums_of_vocabulary_slices_add_up_to_the_whole():
    """What TP ranks do (``_over_ranks`` without its all-reduces): each slice's sums relative to its own max, moved to
    the max over slices and added, are the whole vocabulary's; a slice of padding only adds nothing."""
    from grpo_core.actor.logprobs import _shifted, _softmax_sums

    torch.manual_seed(0)
    logits = torch.randn(4, 60, dtype=torch.float64) * 4
    whole = _softmax_sums(logits, 60)
    slices = [_softmax_sums(logits[:, :25], 25), _softmax_sums(logits[:, 25:], 35), _softmax_sums(logits[:, :10], 0)]
    top = torch.stack([s[0] for s in slices]).amax(0)
    torch.testing.assert_close(top, whole[0])
    torch.testing.assert_close(sum(_shifted(s, top) for s in slices), whole[1:], atol=1e-6, rtol=1e-6)  # fp32 sums


def _check_log_probs_against_reference(log_probs_and_entropy, vocab_size: int) -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 50, dtype=torch.float64) * 3
    logits[..., vocab_size:] = 7.0  # padding columns with large logits: a leak would show
    labels = torch.randint(0, vocab_size, (3, 5))
    g_lp, g_ent = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)

    ours = logits.clone().requires_grad_()
    lp, ent = log_probs_and_entropy(ours, labels, vocab_size, entropy_grad=True)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()

    ref = logits.clone().requires_grad_()
    log_p = torch.log_softmax(ref[..., :vocab_size], -1)
    ref_lp = log_p.gather(-1, labels[..., None])[..., 0]
    ref_ent = -(log_p.exp() * log_p).sum(-1)
    ((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum()).backward()

    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.grad, ref.grad, atol=1e-5, rtol=0)  # zero at the padding columns
    assert torch.equal(ours.detach(), logits)  # the caller's logits are not written over


def test_micro_batches_drop_only_the_prompt_columns_every_row_pads():
    """A micro-batch of short prompts is cut to its longest prompt; responses and positions are untouched."""
    from grpo_core.data.batch import RolloutBatch

    ids = torch.arange(2 * 9).view(2, 9)
    attention = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1, 1, 1]])
    batch = RolloutBatch(input_ids=ids, attention_mask=attention, response_mask=torch.ones(2, 4))
    cut = batch.without_leading_padding()
    assert torch.equal(cut.input_ids, ids[:, 2:]) and torch.equal(cut.attention_mask, attention[:, 2:])
    assert torch.equal(cut.responses, batch.responses)
    real = attention.bool()
    assert torch.equal(cut.position_ids[real[:, 2:]], batch.position_ids[real])
    assert batch.rows(slice(1, 2)).without_leading_padding().input_ids.shape[1] == 7


def _two_rows():
    """Row 0: prompt [.. 3 4] + response [5 6 7]; row 1: prompt [10 11 12 13] + response [14 _ _]."""
    from grpo_core.data.batch import RolloutBatch

    ids = torch.tensor([[0, 0, 3, 4, 5, 6, 7], [10, 11, 12, 13, 14, 0, 0]])
    attention = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0]])
    return RolloutBatch(input_ids=ids, attention_mask=attention, response_mask=attention[:, 4:].float())


def test_packing_lays_rows_end_to_end_and_maps_each_response_token_to_its_logits():
    from grpo_core.actor.packing import pack

    batch = _two_rows()
    packed = pack(batch, multiple=4)  # 10 real tokens, rounded up to 12: the 2 padding tokens are a sequence
    assert packed.input_ids.tolist() == [[3, 4, 5, 6, 7, 10, 11, 12, 13, 14, 0, 0]]
    assert packed.params.cu_seqlens_q.tolist() == [0, 5, 10, 12] and packed.params.max_seqlen_q == 5
    # row 0's response 5 6 7 sits at 2 3 4, predicted from 1 2 3; row 1's 14 at 9, from 8; padding: its last token
    assert packed.logit_index.tolist() == [[1, 2, 3], [8, 9, 9]]
    next_token = packed.input_ids.roll(-1, dims=1)[0]
    real = batch.response_mask.bool()
    assert torch.equal(next_token[packed.logit_index][real], batch.responses[real])
    assert pack(batch, length=16).input_ids.shape == (1, 16)  # pipeline stages: one length for every micro-batch
    holes = _two_rows()
    holes.attention_mask[1, 2] = 0
    with pytest.raises(ValueError, match="contiguous"):
        pack(holes)


def test_token_budget_groups_consecutive_rows():
    from grpo_core.actor.packing import split_by_tokens
    from grpo_core.data.batch import RolloutBatch

    lengths = [5, 4, 6, 2, 3]
    attention = torch.tensor([[0] * (6 - n) + [1] * n for n in lengths])  # left-aligned runs to the end
    batch = RolloutBatch(
        input_ids=torch.arange(30).view(5, 6), attention_mask=attention, response_mask=torch.ones(5, 1)
    )
    packed = split_by_tokens(batch, budget=9, packed=True)  # real tokens: 5+4 | 6+2 | 3
    assert [g.input_ids[:, 0].tolist() for g in packed] == [[0, 6], [12, 18], [24]]
    padded = split_by_tokens(batch, budget=9, packed=False)  # rows x widest: 1x5 | 1x4 (2x6 > 9) | 6 | 2x3 (3x3=9)
    assert [g.batch_size for g in padded] == [1, 1, 1, 2]
    assert [g.batch_size for g in split_by_tokens(batch, budget=2, packed=True)] == [1] * 5  # too long: alone


def test_packed_rope_restarts_positions_like_megatrons_per_sequence_loop():
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd

    from grpo_core.models import fused

    class OneRank:  # a context-parallel group of one
        def size(self):
            return 1

        def rank(self):
            return 0

    torch.manual_seed(0)
    t = torch.randn(12, 3, 8)
    freqs = torch.randn(7, 1, 1, 8)
    cu = torch.tensor([0, 5, 7, 12], dtype=torch.int32)
    ref = _apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=OneRank())
    torch.testing.assert_close(fused._rope_thd(t, cu, freqs), ref, atol=1e-6, rtol=0)
    # the angles' cos and sin are computed once for the queries and keys of every layer, again for a new pack
    first = fused._cos_sin.get(t.dtype, freqs, cu, 12)
    assert fused._cos_sin.get(t.dtype, freqs, cu, 12) is first
    other = cu.clone()
    assert fused._cos_sin.get(t.dtype, freqs, other, 12) is not first
    torch.testing.assert_close(fused._rope_thd(t, other, freqs), ref, atol=1e-6, rtol=0)
    # padded rows [s, b, heads, d] and a partial rotation (half of each head) through the general form
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    rows = torch.randn(7, 2, 3, 8)
    torch.testing.assert_close(
        fused._rope_bshd(rows, freqs), _apply_rotary_pos_emb_bshd(rows, freqs), atol=1e-6, rtol=0
    )
    half = freqs[..., :4]
    torch.testing.assert_close(fused._rope_bshd(rows, half), _apply_rotary_pos_emb_bshd(rows, half), atol=1e-6, rtol=0)


def test_shuffled_epochs_keep_the_stepped_rows_in_front_and_permute_the_rest():
    """actor.shuffle: a permutation of the rows per PPO epoch (the same for the same seed: every DP rank draws
    alike), the first epoch's rows already stepped on (an on-policy update's first mini-batch) kept in front."""
    from grpo_core.actor.actor import epoch_orders

    orders = epoch_orders(12, 3, 4, torch.Generator().manual_seed(5))
    assert orders[0][:4].tolist() == [0, 1, 2, 3]
    assert all(sorted(order.tolist()) == list(range(12)) for order in orders)
    assert len({tuple(order.tolist()) for order in orders}) == 3 and list(range(12)) not in [o.tolist() for o in orders]
    again = epoch_orders(12, 3, 4, torch.Generator().manual_seed(5))
    assert all(torch.equal(a, b) for a, b in zip(orders, again, strict=True))


@pytest.mark.parametrize("packed", [True, False])
def test_split_rope_matches_megatrons_split_then_rope(packed):
    """The QKV projection split and rotated in one step gives megatron's queries, keys and values (its split, the
    query reshape, then its RoPE per packed sequence or over padded rows), and the same gradient to the projection."""
    from megatron.core.models.common.embeddings.rope_utils import (
        _apply_rotary_pos_emb_bshd,
        _apply_rotary_pos_emb_thd,
    )

    from grpo_core.models import fused

    class OneRank:
        def size(self):
            return 1

        def rank(self):
            return 0

    torch.manual_seed(0)
    groups, per_group, d = 2, 3, 8  # 6 query heads over 2 KV heads
    s, b = (12, 1) if packed else (7, 2)
    mixed = torch.randn(s, b, groups, (per_group + 2) * d, dtype=torch.float64, requires_grad=True)
    # packed: angles for the longest sequence, as megatron's GPTModel passes them (with one per packed token its
    # per-sequence loop would offset each sequence's positions by its start)
    freqs = torch.randn(5 if packed else s, 1, 1, d, dtype=torch.float64)
    cu = torch.tensor([0, 5, 7, 12], dtype=torch.int32) if packed else None

    def megatrons(x):
        q, k, v = torch.split(x, [per_group * d, d, d], dim=3)
        q = q.reshape(s, b, -1, d)
        if packed:
            q, k, v = q.squeeze(1), k.squeeze(1), v.squeeze(1)
            return (
                _apply_rotary_pos_emb_thd(q, cu, freqs, cp_group=OneRank()),
                _apply_rotary_pos_emb_thd(k, cu, freqs, cp_group=OneRank()),
                v,
            )
        return _apply_rotary_pos_emb_bshd(q, freqs), _apply_rotary_pos_emb_bshd(k, freqs), v

    ours = fused.split_rope(mixed, freqs, per_group, cu)
    if packed:
        ours = tuple(t.squeeze(1) for t in ours)
    reference = megatrons(mixed)
    grads = [torch.randn_like(t) for t in reference]
    for a, r in zip(ours, reference, strict=True):
        assert a.is_contiguous() and a.shape == r.shape
        torch.testing.assert_close(a, r, atol=1e-12, rtol=0)
    mine = torch.autograd.grad(ours, mixed, grads)[0]
    torch.testing.assert_close(mine, torch.autograd.grad(reference, mixed, grads)[0], atol=1e-12, rtol=0)


def test_linear_bias_added_after_megatrons_gemm_keeps_its_outputs_and_gradients(monkeypatch):
    """``install_bias_add``: megatron's two linear functions run without the bias and add it after; outputs and the
    input, weight and bias gradients are those of ``F.linear``."""
    from megatron.core.tensor_parallel import layers

    from grpo_core.models import fused

    fn = layers.LinearWithGradAccumulationAndAsyncCommunication
    extra = (None,) * (len(inspect.signature(fn.forward).parameters) - 10)  # 0.19's gtp_remat_size
    for cls in (layers.LinearWithFrozenWeight, fn):
        monkeypatch.setattr(cls, "forward", cls.__dict__["forward"])  # restored after the test
    fused.install_bias_add()
    fused.install_bias_add()  # twice: wrapped once
    assert fn.forward.adds_bias_compiled and fn.forward.__kwdefaults__["_forward"].__name__ == "forward"
    torch.manual_seed(0)
    x = torch.randn(5, 2, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(6, dtype=torch.float64, requires_grad=True)
    g = torch.randn(5, 2, 6, dtype=torch.float64)
    ref = torch.nn.functional.linear(x, weight, bias)
    expected = torch.autograd.grad(ref, (x, weight, bias), g)
    out = fn.apply(x, weight, bias, False, False, False, None, 0, None, *extra)
    torch.testing.assert_close(out, ref)
    for got, want in zip(torch.autograd.grad(out, (x, weight, bias), g), expected, strict=True):
        torch.testing.assert_close(got, want)
    frozen = layers.LinearWithFrozenWeight.apply(x, weight.detach(), bias.detach(), False, None)
    torch.testing.assert_close(frozen, ref)
    torch.testing.assert_close(torch.autograd.grad(frozen, x, g)[0], expected[0])


def test_megatron_linears_on_packed_weights_keep_their_products(monkeypatch):
    """models/packed.py: inside ``packed_weights()`` a bf16 linear on a CPU with bf16 matrix instructions runs on
    weights packed once for all its calls, with the output and the input, weight and bias gradients of ``F.linear``
    bit for bit (a frozen weight: no gradient); outside the scope, or with tensor-parallel communication, megatron's
    own function runs."""
    import torch.nn.functional as F

    from grpo_core.models import packed

    if not packed.can_pack(torch.device("cpu"), torch.bfloat16):
        pytest.skip("this CPU has no bf16 matrix instructions")
    calls, packs = [], []
    monkeypatch.setattr(packed, "pack", lambda w, rows, pack=packed.pack: packs.append(w.shape) or pack(w, rows))

    def megatron_linear(input, weight, bias, *flags, **kwargs):
        calls.append(flags)
        return F.linear(input, weight, bias)

    megatron_linear.warned = False  # megatron's function keeps a flag it reads through the module's name
    linear = packed._on_packed_weights(megatron_linear)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 64, generator=g).bfloat16().requires_grad_()
    weight = torch.randn(48, 64, generator=g).bfloat16().requires_grad_()
    bias = torch.randn(48, generator=g).bfloat16().requires_grad_()
    grad = torch.randn(7, 3, 48, generator=g).bfloat16()
    want = F.linear(x, weight, bias)
    want_grads = torch.autograd.grad(want, (x, weight, bias), grad)
    with packed.packed_weights():
        for _ in range(2):  # the second call reuses the packs
            got = linear(x, weight, bias, False, False, False)
            assert torch.equal(got, want)
            for mine, reference in zip(torch.autograd.grad(got, (x, weight, bias), grad), want_grads, strict=True):
                assert torch.equal(mine, reference)
        frozen = linear(x, weight.detach(), None, False, False, False)
        assert torch.equal(
            torch.autograd.grad(frozen, x, grad)[0], torch.autograd.grad(F.linear(x, weight), x, grad)[0]
        )
        assert packs == [(48, 64), (64, 48)] * 2 and not calls  # the detached weight is a tensor of its own
        linear(x, weight, bias, False, True, False)  # TP: the input gradient is all-reduced
    linear(x, weight, bias, False, False, False)
    assert calls == [(False, True, False), (False, False, False)] and linear.warned is False


def test_a_bf16_cpu_model_compiles_its_element_wise_chains_and_an_fp32_one_stays_eager(monkeypatch):
    """``fused.fusion_flags`` on a CPU: megatron's fusion flags and the compiled kernels behind them for a bf16 model
    where a C++ compiler is found (``fused.compiles`` then holds for bf16 tensors), none for fp32 or without one."""
    from grpo_core.models import fused, packed

    installed = []
    for module, name in ((fused, "install_fused_rope"), (fused, "install_swiglu_back"), (fused, "install_bias_add"),
                         (packed, "install")):  # fmt: skip
        monkeypatch.setattr(module, name, lambda name=name: installed.append(name))
    monkeypatch.setattr(fused, "_compile_on_cpu", False)
    bf16 = torch.zeros(2, dtype=torch.bfloat16)
    assert fused.fusion_flags({}, torch.float32) == {} and not installed
    packs = ["install"] * packed.can_pack(torch.device("cpu"), torch.bfloat16)  # where oneDNN has bf16
    monkeypatch.setattr(fused, "can_compile_on_cpu", lambda: False)
    assert fused.fusion_flags({}, torch.bfloat16) == {} and installed == packs and not fused.compiles(bf16)
    monkeypatch.setattr(fused, "can_compile_on_cpu", lambda: True)
    installed.clear()
    assert fused.fusion_flags({}, torch.bfloat16) == {"bias_activation_fusion": True, "apply_rope_fusion": True}
    assert fused.compiles(bf16) and not fused.compiles(bf16.float())
    assert installed == [*packs, "install_fused_rope", "install_bias_add"]  # megatron's own SwiGLU backward


def test_a_bf16_gradient_is_added_to_its_fp32_main_grad_in_one_compiled_pass(monkeypatch):
    """``fused.accumulate``: main_grad += grad as torch's eager add gives it, compiled where ``fused.compiles`` (a
    bf16 CPU process with a C++ compiler); elsewhere it leaves the add to megatron (False)."""
    from grpo_core.models import fused

    g = torch.Generator().manual_seed(0)
    main = torch.randn(40, 24, generator=g)
    grad = torch.randn(40, 24, generator=g).bfloat16()
    want = main + grad
    monkeypatch.setattr(fused, "_compile_on_cpu", False)
    assert not fused.accumulate(main, grad) and not torch.equal(main, want)
    monkeypatch.setattr(fused, "_compile_on_cpu", True)
    assert not fused.accumulate(main, grad.float())  # fp32 gradients: nothing to fuse
    if not fused.can_compile_on_cpu():
        pytest.skip("no C++ compiler for torch.compile")
    assert fused.accumulate(main, grad) and torch.equal(main, want)
    assert fused.accumulate(main[:, 0], grad[:, 0]) is False  # a strided view: megatron's add


def test_swiglu_backward_is_the_autograd_gradient_of_silu_gate_times_up():
    from grpo_core.models import fused

    torch.manual_seed(0)
    y = torch.randn(6, 10, dtype=torch.float64, requires_grad=True)  # [gate | up]
    g = torch.randn(6, 5, dtype=torch.float64)
    gate, up = y.chunk(2, -1)
    (torch.nn.functional.silu(gate) * up).backward(g)
    torch.testing.assert_close(fused._swiglu_back(g, y.detach()), y.grad, atol=1e-12, rtol=0)


def test_host_copies_lie_end_to_end_in_power_of_two_chunks(monkeypatch):
    """Storages of several dtypes cross chunk boundaries and come back whole; the host holds their bytes in
    full chunks and one last power of two (torch's pinned allocator would round each storage up instead)."""
    from grpo_core.actor import offload

    monkeypatch.setattr(offload, "CHUNK_BYTES", 16)
    tensors = [torch.arange(10, dtype=torch.float32), torch.arange(6, dtype=torch.int16), torch.arange(3.0).double()]
    before = [t.clone() for t in tensors]
    host = offload.HostOffloader(frozen=True)
    assert host.offload(tensors) == 40 + 12 + 24
    assert [chunk.numel() for chunk in host._host] == [16, 16, 16, 16, 16]  # 76 bytes: four full chunks, 12 -> 16
    assert all(t.untyped_storage().size() == 0 for t in tensors)
    assert host.reload() == 76 and all(torch.equal(t, b) for t, b in zip(tensors, before, strict=True))
    assert [c.numel() for c in offload.host_chunks(16 * 3 + 5)] == [16, 16, 16, 8]


def test_a_token_budget_gives_one_number_of_rows_where_shapes_must_agree():
    """Pipeline stages on unpacked rows (context parallelism): the most whole rows the budget holds that divide the
    batch, at least one."""
    from grpo_core.actor.actor import rows_in_budget

    assert rows_in_budget(8, width=12, tokens=19) == 1
    assert rows_in_budget(8, width=12, tokens=40) == 2  # 3 rows fit, but 8 rows do not split into threes
    assert rows_in_budget(6, width=10, tokens=35) == 3
    assert rows_in_budget(4, width=10, tokens=5) == 1  # a budget below one row still takes one
    assert rows_in_budget(4, width=10, tokens=1000) == 4


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 0.05)])
def test_the_cpu_s_attention_by_products_is_causal_sdpa(dtype, tol):
    """``fused.causal_attention_by_products`` (a CPU's packed rows, short ones) against fp32 SDPA: the output and the
    gradients of the queries, keys and values, 6 query heads over 2 KV heads, a scale that is not 1/sqrt(d); rows
    whose scores would pass ``PRODUCTS_ATTENTION_BYTES`` are left to torch's flash kernel (None)."""
    import torch.nn.functional as F

    from grpo_core.models import fused

    g = torch.Generator().manual_seed(0)
    shapes = ((3, 6, 21, 16), (3, 2, 21, 16), (3, 2, 21, 16))
    q, k, v = (torch.randn(*s, generator=g).to(dtype).requires_grad_() for s in shapes)
    grad = torch.randn(3, 6, 21, 16, generator=g).to(dtype)
    want_q, want_k, want_v = (t.detach().float().requires_grad_() for t in (q, k, v))
    want = F.scaled_dot_product_attention(want_q, want_k, want_v, is_causal=True, scale=0.3, enable_gqa=True)
    want.backward(grad.float())
    got = fused.causal_attention_by_products(q, k, v, 0.3)
    got.backward(grad)
    assert got.dtype == dtype
    for mine, reference in ((got, want), (q.grad, want_q.grad), (k.grad, want_k.grad), (v.grad, want_v.grad)):
        torch.testing.assert_close(mine.float(), reference, atol=tol, rtol=0)
    wide = torch.zeros(1, 1, 4097, 4)  # 4097^2 fp32 scores: 67 MB, past the 64 MiB
    assert fused.causal_attention_by_products(wide, wide, wide, 1.0) is None
