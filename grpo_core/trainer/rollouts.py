"""A step's rollouts: each rollout replica generates its share of the prompts, every rank gathers them all and
scores them with the reward; with dynamic sampling (``algorithm.filter_groups``) from as many prompt batches as it
takes. Validation generates and scores the same way, with ``rollout.val_kwargs``.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from grpo_core.algos import draw_again, filter_metric_values, groups_with_spread, overlong_penalty, trainable_groups
from grpo_core.config import GRPOConfig
from grpo_core.data.prompts import Prompt, PromptSampler, decode_responses
from grpo_core.numerics import NotFinite, first_non_finite
from grpo_core.planning.layout import actor_layout
from grpo_core.rewards import Scorer, reward_name
from grpo_core.rollout import Generation, SamplingSettings, draw
from grpo_core.trainer import metrics as M


@dataclass
class Rollouts:
    """A step's generations on every rank, scored."""

    gen: Generation
    scores: list[float]  # one per response
    baseline_scores: list[float] | None = None  # one per prompt: its greedy response's (remax)

    def groups(self, chosen: list[int]) -> "Rollouts":
        """The prompt groups ``chosen``, renumbered (``Generation.groups``), with their scores."""
        rows = [r for c in chosen for r, g in enumerate(self.gen.group_index) if g == c]
        baselines = None if self.baseline_scores is None else [self.baseline_scores[c] for c in chosen]
        return Rollouts(self.gen.groups(chosen), [self.scores[r] for r in rows], baselines)

    @classmethod
    def concat(cls, parts: "list[Rollouts]") -> "Rollouts":
        """The parts one after another (``Generation.concat``), baselines kept when every part has them."""
        baselines = [s for r in parts for s in r.baseline_scores or []]
        whole = all(r.baseline_scores is not None for r in parts)
        return Rollouts(
            Generation.concat(r.gen for r in parts),
            [s for r in parts for s in r.scores],
            baselines if whole and parts else None,
        )


@dataclass
class StepDraw:
    """A step's rollouts and how they were drawn: with dynamic sampling, several prompt batches' kept groups."""

    rollouts: Rollouts
    gen_batches: int  # prompt batches drawn (each moves the data position by one)
    groups_kept: int  # groups trained on
    groups_with_signal: float  # share of all drawn groups whose (shaped) rewards differ
    drawn_reward_mean: float  # mean rule reward of every response drawn, kept or not


def rollout_sampling(cfg: GRPOConfig) -> SamplingSettings:
    """How training rollouts are sampled (``rollout.*``); ``validate`` uses ``rollout.val_kwargs``."""
    rollout = cfg.actor_rollout_ref.rollout
    return SamplingSettings(
        n=rollout.n,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        max_new_tokens=cfg.data.max_response_length,
        greedy_baseline=cfg.algorithm.adv_estimator == "remax",
    )


def generate(
    engine, prompts: list[Prompt], settings: SamplingSettings, tokenizer, cfg: GRPOConfig, scorer: Scorer
) -> Rollouts:
    """Each rollout replica samples its contiguous share of ``prompts``; every rank gets all of it, scored."""
    tp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
    replicas, replica = dist.get_world_size() // tp, dist.get_rank() // tp
    share = -(-len(prompts) // replicas)
    mine = prompts[replica * share : (replica + 1) * share]
    local = draw(engine, [p.ids for p in mine], settings) if engine is not None and mine else None
    gen = _gather_generations(local if dist.get_rank() % tp == 0 else None)  # a replica's rows once
    scores = _score(gen.response_ids, gen.group_index, prompts, tokenizer, cfg, scorer)
    baselines = None
    if gen.baseline_ids is not None:  # remax: each prompt's greedy response, scored by the same reward
        baselines = _score(gen.baseline_ids, list(range(len(prompts))), prompts, tokenizer, cfg, scorer, "greedy ")
    return Rollouts(gen, scores, baselines)


def _score(
    responses: list[list[int]],
    groups: list[int],
    prompts: list[Prompt],
    tokenizer,
    cfg: GRPOConfig,
    scorer: Scorer,
    kind: str = "",
) -> list[float]:
    """The reward of each response to its prompt (``groups``); a reward that is not a finite number stops the run."""
    scores = []
    for text, group in zip(decode_responses(tokenizer, responses), groups, strict=True):
        prompt = prompts[group]
        scores.append(scorer(prompt.data_source, text, prompt.ground_truth, prompt.extra_info))
    if (bad := first_non_finite(scores)) is not None:  # every rank scores every response: all stop here
        row, value = bad
        prompt = prompts[groups[row]]
        raise NotFinite(
            f"{reward_name(cfg, prompt.data_source)} returned {value} for {kind}response {row} of the batch (prompt "
            f"{groups[row]}, ground truth {prompt.ground_truth!r:.40}); a reward must be a finite number. "
            "The run stopped before the update: nothing of this step was trained or saved"
        )
    return scores


def _gather_generations(local: Generation | None) -> Generation:
    """Concatenate the replicas' generations in rank order, renumbering their prompt groups."""
    if dist.get_world_size() == 1:  # nothing to gather: skip pickling 512 x 256 tokens and log-probs both ways
        return local
    parts: list[Generation | None] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return Generation.concat(part for part in parts if part is not None)


def draw_rollouts(
    engine, sampler: PromptSampler, position: int, sampling: SamplingSettings, tokenizer, cfg: GRPOConfig, scorer
) -> StepDraw:
    """The step's rollouts from the prompt batch at data position ``position``. With dynamic sampling
    (``algorithm.filter_groups``), the groups whose ``metric`` differs within the group, from as many batches
    as it takes to collect ``data.train_batch_size`` of them or as ``max_num_gen_batches`` allows; a short step
    keeps what divides over the data-parallel ranks (the last batch whole if that is nothing)."""
    fg, wanted = cfg.algorithm.filter_groups, cfg.data.train_batch_size
    kept: list[Rollouts] = []
    count = drawn = 0
    signal, reward_sum, responses = [], 0.0, 0
    while drawn == 0 or (fg.enable and draw_again(count, wanted, drawn, fg.max_num_gen_batches)):
        rollouts = generate(engine, sampler.batch(position + drawn), sampling, tokenizer, cfg, scorer)
        drawn += 1
        shaped, _ = shaped_scores(rollouts, cfg)
        signal.append(M.groups_with_signal(shaped, rollouts.gen.group_index))
        reward_sum, responses = reward_sum + sum(rollouts.scores), responses + len(rollouts.scores)
        if not fg.enable:
            kept, count = [rollouts], len(rollouts.gen.prompt_ids)
            break
        values = filter_metric_values(fg.metric, rollouts.scores, shaped, cfg.reward_model.score)
        chosen = groups_with_spread(values, rollouts.gen.group_index)[: wanted - count]
        kept.append(rollouts.groups(chosen))
        count += len(chosen)
    merged = Rollouts.concat(kept)
    if count < wanted:
        count = trainable_groups(count, sampling.n, actor_layout(cfg).dp)
        merged = merged.groups(list(range(count))) if count else rollouts
    return StepDraw(merged, drawn, count, sum(signal) / len(signal), reward_sum / responses)


def sampling_metrics(drawn: StepDraw, cfg: GRPOConfig) -> dict[str, float]:
    """How the step's groups were drawn, logged with dynamic sampling on."""
    if not cfg.algorithm.filter_groups.enable:
        return {}
    return {
        "batch/gen_batches": drawn.gen_batches,
        "batch/groups_kept": drawn.groups_kept,
        "batch/drawn_reward_mean": drawn.drawn_reward_mean,
    }


def shaped_scores(rollouts: Rollouts, cfg: GRPOConfig) -> tuple[list[float], dict[str, float]]:
    """The scores the advantage sees: with reward_manager=dapo and its overlong buffer on, each response's
    rule score plus DAPO's overlong penalty (reward/* metrics keep the rule scores, so accuracy stays readable)."""
    penalty = _overlong(rollouts.gen.response_ids, cfg)
    if penalty is None:
        return rollouts.scores, {}
    scores = (torch.tensor(rollouts.scores, dtype=torch.float64) + penalty).tolist()
    metrics = {
        "reward/overlong_penalty_mean": penalty.mean().item(),
        "reward/overlong_share": (penalty < 0).double().mean().item(),
    }
    return scores, metrics


def shaped_baselines(rollouts: Rollouts, cfg: GRPOConfig) -> list[float] | None:
    """remax's baselines (each prompt's greedy response's score) shaped as the scores they are compared with."""
    baselines = rollouts.baseline_scores
    penalty = None if baselines is None else _overlong(rollouts.gen.baseline_ids, cfg)
    return baselines if penalty is None else (torch.tensor(baselines, dtype=torch.float64) + penalty).tolist()


def _overlong(responses: list[list[int]], cfg: GRPOConfig) -> torch.Tensor | None:
    """DAPO's overlong penalty of each response with reward_manager=dapo and its overlong buffer on, else None."""
    rm = cfg.reward_model
    buffer = rm.reward_kwargs.overlong_buffer_cfg
    if rm.reward_manager != "dapo" or not buffer.enable:
        return None
    lengths = torch.tensor([len(r) for r in responses])
    return overlong_penalty(lengths, rm.reward_kwargs.max_resp_len, buffer.len, buffer.penalty_factor)


def validate(cfg: GRPOConfig, engine, prompts: list[Prompt], tokenizer, scorer: Scorer) -> dict[str, float]:
    """Greedy (or val_kwargs) samples of the validation prompts: mean reward and accuracy (full score)."""
    val = cfg.actor_rollout_ref.rollout.val_kwargs
    settings = SamplingSettings(
        n=val.n,
        temperature=val.temperature if val.do_sample else 0.0,
        top_p=val.top_p,
        top_k=val.top_k,
        max_new_tokens=cfg.data.max_response_length,
    )
    size = cfg.data.val_batch_size or len(prompts)
    scores, lengths = [], []
    for first in range(0, len(prompts), size):
        rollouts = generate(engine, prompts[first : first + size], settings, tokenizer, cfg, scorer)
        scores += rollouts.scores
        lengths += [len(r) for r in rollouts.gen.response_ids]
    full = cfg.reward_model.score
    return {
        "val/reward_mean": sum(scores) / len(scores),
        "val/accuracy": sum(s >= full for s in scores) / len(scores),
        "val/response_length_mean": sum(lengths) / len(lengths),
    }
