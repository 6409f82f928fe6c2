"""Per-step metrics as pure functions of the step's data and timings (verl's names where verl has one)."""

import resource

import torch

from grpo_core.algos import rollout_is_metrics, rollout_is_weights
from grpo_core.config.defaults import SETTING, defaults_from
from grpo_core.data.batch import RolloutBatch
from grpo_core.models.shape import ModelShape
from grpo_core.rollout.base import Generation

# Dense bf16 peak FLOP/s per GPU, for MFU. Unknown devices (and CPUs) get no MFU rather than a guess.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def groups_with_signal(scores: list[float], group_index: list[int]) -> float:
    """Share of prompt groups whose responses' scores differ: a group of equal scores has advantage 0 for every
    response, so GRPO learns nothing from it."""
    groups: dict[int, set[float]] = {}
    for score, group in zip(scores, group_index, strict=True):
        groups.setdefault(group, set()).add(score)
    return _mean([len(values) > 1 for values in groups.values()])


@defaults_from("reward_model")
def rollout_metrics(
    gen: Generation, scores: list[float], batch: RolloutBatch, full_score: float, format_score: float = SETTING
) -> dict[str, float]:
    """``reward/format_rate`` (with a reward for the format alone): the share of answers in the expected format,
    right or wrong, i.e. scored at least ``format_score``."""
    lengths = [len(r) for r in gen.response_ids]
    t = torch.tensor(scores, dtype=torch.float64)
    prompt_lengths = (batch.attention_mask.sum(-1) - batch.response_mask.sum(-1)).float()
    return {
        "reward/mean": t.mean().item(),
        "reward/std": t.std().item() if len(scores) > 1 else 0.0,
        "reward/max": t.max().item(),
        "reward/min": t.min().item(),
        "reward/accuracy": _mean([s >= full_score for s in scores]),
        "response/length_mean": _mean(lengths),
        "response/length_max": float(max(lengths)),
        "response/clip_ratio": _mean([r == "length" for r in gen.finish_reasons]),
        "prompt/length_mean": prompt_lengths.mean().item(),
    } | ({"reward/format_rate": _mean([s >= format_score for s in scores])} if format_score > 0 else {})


def baseline_metrics(baselines: list[float] | None, scores: list[float], group_index: list[int]) -> dict[str, float]:
    """remax's greedy baselines (one per prompt): their mean reward, and the share of sampled responses that beat
    their prompt's greedy one (those are the ones pushed up). Nothing without baselines."""
    if baselines is None:
        return {}
    return {
        "reward/remax_baseline_mean": _mean(baselines),
        "reward/remax_above_baseline": _mean([s > baselines[g] for s, g in zip(scores, group_index, strict=True)]),
    }


def log_prob_metrics(batch: RolloutBatch, entropy: torch.Tensor) -> dict[str, float]:
    """The rollout engine's log-probs against the actor's: a large gap means the weight sync is broken."""
    mask = batch.response_mask.bool()
    diff = (batch.rollout_log_probs - batch.old_log_probs).abs()[mask]
    return {
        "actor/entropy_before_update": entropy[mask].mean().item(),
        "rollout/log_prob_diff_mean": diff.mean().item(),
        "rollout/log_prob_diff_max": diff.max().item(),
    }


def rollout_correction_metrics(batch: RolloutBatch, level: str | None, threshold: float) -> dict[str, float]:
    """``rollout_is/*`` of the step's importance weights (the update recomputes the same ones per micro-batch:
    they depend only on the old and the rollout log-probs); nothing when rollout_is is off."""
    if level is None:
        return {}
    weights = rollout_is_weights(batch.old_log_probs, batch.rollout_log_probs, batch.response_mask, level, threshold)
    return rollout_is_metrics(weights, batch.response_mask, threshold)


def timing_metrics(timings: dict[str, float]) -> dict[str, float]:
    return {f"timing/{name}": seconds for name, seconds in timings.items()}


def throughput_metrics(batch: RolloutBatch, timings: dict[str, float], shape: ModelShape, world: int) -> dict:
    """Tokens (prompt + response, no padding) per second per GPU over the whole step, and the update's MFU.

    Training FLOPs per token (forward + backward): 6 x parameters for the matmuls, plus
    6 x layers x hidden x sequence for causal attention's scores and weighted sums.
    """
    tokens = int(batch.attention_mask.sum())
    seq = batch.input_ids.shape[1]
    metrics = {
        "perf/total_tokens": float(tokens),
        "perf/throughput": tokens / max(timings["step"], 1e-9) / world,
        "perf/max_memory_gib": peak_memory_gib(),
    }
    peak = peak_flops()
    if peak and "update" in timings:
        flops = tokens * (6 * shape.num_params + 6 * shape.num_layers * shape.hidden_size * seq)
        metrics["perf/mfu/actor"] = flops / timings["update"] / (peak * world)
    return metrics


def peak_flops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((flops for key, flops in PEAK_FLOPS.items() if key in name), None)


def reset_peak_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_memory_gib() -> float:
    """GPU: peak allocated this step. CPU: the process's peak resident set (since it started)."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
