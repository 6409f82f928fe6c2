"""Run by torchrun from tests/test_family_steps.py: two real updates of the tiny model through the actor's code path
for each of verl's policy losses, advantage estimators and rollout-correction settings.

Each case is a verl command line's algorithm keys (tests/test_family_steps.py checks they pass --dry-run): the loss
settings come from the loaded config (``LossSettings.from_config``), the advantages from its estimator (``advantage_options``), and
the batch the update trains on from the trainer's ``rollout_correction``. From the same initial weights, each case
runs: old log-probs -> update -> old log-probs -> update; rank 0 writes each step's metrics and, per row, the mean
log-prob before and after as JSON.
"""

import argparse
import dataclasses
import json

import torch
import torch.distributed as dist

from grpo_core.actor.actor import ActorSettings, MegatronActor
from grpo_core.actor.loss import LossSettings
from grpo_core.actor.parallel import init_distributed, init_model_parallel
from grpo_core.algos import get_adv_estimator
from grpo_core.config import load_config
from grpo_core.models.shape import load_model_shape
from grpo_core.planning.layout import ParallelLayout
from grpo_core.trainer.advantages import advantage_options, rollout_correction
from tests.dist.actor_worker import FAMILY_SCORES, synthetic_batch, with_old_and_ref

LOSS_KEY = "actor_rollout_ref.actor.policy_loss.loss_mode"
RC = "algorithm.rollout_correction"
CASES: dict[str, list[str]] = {
    **{
        f"loss/{name}": [f"{LOSS_KEY}={name}", *extra]
        for name, extra in {
            "vanilla": [],
            "gspo": ["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"],
            "sapo": ["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"],
            "cispo": ["actor_rollout_ref.actor.clip_ratio_low=10", "actor_rollout_ref.actor.clip_ratio_high=0.2"],
            "geo_mean": ["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"],
            "gpg": ["algorithm.adv_estimator=gpg"],
            "clip_cov": ["actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0.1"],
            "kl_cov": ["actor_rollout_ref.actor.policy_loss.kl_cov_ratio=0.1"],
            "dppo_tv": [],
            "dppo_kl": [],
            "dro": ["actor_rollout_ref.actor.policy_loss.dro_beta=0.1"],
        }.items()
    },
    **{
        f"estimator/{name}": [f"algorithm.adv_estimator={name}"]
        for name in (
            "grpo",
            "grpo_vectorized",
            "rloo",
            "rloo_vectorized",
            "reinforce_plus_plus",
            "reinforce_plus_plus_baseline",
            "gdpo",
            "grpo_passk",
            "opo",
            "gpg",
            "remax",
        )
    },  # fmt: skip
    "correction/icepop_token": [f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=0.5_2.0"],
    "correction/sequence_normalized": [f"{RC}.rollout_is=sequence", f"{RC}.rollout_is_batch_normalize=true"],
    "correction/rs_token_k1_seq_max_k3": [
        f"{RC}.rollout_is=token",
        f"{RC}.rollout_rs=token_k1,seq_max_k3",
        f"{RC}.rollout_rs_threshold=0.5_2.0,0.5",
    ],
    "correction/bypass_ppo_clip": [
        f"{RC}.bypass_mode=true",
        f"{RC}.rollout_rs=seq_mean_k3",
        f"{RC}.rollout_rs_threshold=0.5",
    ],
    "correction/bypass_reinforce": [
        f"{RC}.bypass_mode=true",
        f"{RC}.loss_type=reinforce",
        f"{RC}.rollout_is=sequence",
        f"{RC}.rollout_is_threshold=2.0",
    ],
}
BASE = ["actor_rollout_ref.rollout.n=4", "data.max_response_length=5"]


def run_case(policy: MegatronActor, base: ActorSettings, overrides: list[str], params, start) -> dict:
    cfg = load_config(None, [*BASE, *overrides])
    with torch.no_grad():
        for p, w in zip(params, start, strict=True):
            p.copy_(w)
    policy.s = dataclasses.replace(base, loss=LossSettings.from_config(cfg))
    batch = synthetic_batch(policy.shape.vocab_size)
    mask = batch.response_mask
    rewards = torch.zeros_like(mask)
    rewards[torch.arange(mask.shape[0]), mask.sum(-1).long() - 1] = torch.tensor(FAMILY_SCORES)
    index = [row // 4 for row in range(mask.shape[0])]
    options = advantage_options(cfg)
    if cfg.algorithm.adv_estimator == "remax":  # each prompt's greedy answer scored 0.5 (the trainer draws it)
        options["reward_baselines"] = torch.full((mask.shape[0],), 0.5, dtype=rewards.dtype)
    batch.advantages, _ = get_adv_estimator(cfg.algorithm.adv_estimator)(rewards, mask, index=index, **options)
    before = policy.compute_log_prob(batch)[0]
    steps = []
    for _ in range(2):
        batch = with_old_and_ref(batch, policy.compute_log_prob(batch)[0])
        trained, correction = rollout_correction(batch, cfg)
        steps.append({**policy.update(trained), **correction})
    after = policy.compute_log_prob(batch)[0]
    per_row = lambda lp: ((lp * mask).sum(-1) / mask.sum(-1)).tolist()  # noqa: E731
    return {
        "steps": steps,
        "advantage": (batch.advantages.sum(-1) / mask.sum(-1)).tolist(),
        "before": per_row(before),
        "after": per_row(after),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    init_distributed()
    shape = load_model_shape(args.hf_dir)
    layout = ParallelLayout(world_size=dist.get_world_size())
    init_model_parallel(layout, seed=7)
    base = ActorSettings(layout=layout, lr=1e-3, mini_batch_rows=8, micro_batch_rows=4)
    policy = MegatronActor(shape, base, hf_path=args.hf_dir)
    params = [p for chunk in policy.model for p in chunk.parameters()]
    start = [p.detach().clone() for p in params]
    results = {name: run_case(policy, base, overrides, params, start) for name, overrides in CASES.items()}
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
