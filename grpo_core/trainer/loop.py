"""The GRPO training loop, run by every torchrun process: rollout -> reward -> advantage -> update -> sync.

Read ``train`` top to bottom: ``set_up`` (setup.py: models, engine, data), ``resume`` (from a checkpoint, if
any), then one ``grpo_step`` per step (its rollouts drawn and scored in rollouts.py, its advantages computed in
advantages.py, its metrics in metrics.py), each followed by validation, logging and the checkpoint when they are due.
Every rank holds the whole batch of each step (the actor slices it by data-parallel rank itself); rollout
engines live on the first rank of each rollout-TP group and generate that replica's share of the prompts;
the results are gathered so all ranks go on with the same rollouts. The megatron engine is the exception:
it generates with the actor's own model, so it lives on every rank (each runs its TP shard) and has no
weights to sync. Only rank 0 logs and writes files.
"""

import gc
import logging
import time
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist

from grpo_core import actor as _cpu_compat  # noqa: F401  (must precede megatron)
from grpo_core.actor.actor import MegatronActor
from grpo_core.checkpoint.manager import check_same_data
from grpo_core.config import GRPOConfig, to_flat_dict
from grpo_core.data.batch import RolloutBatch
from grpo_core.diagnostics.phases import RunDiagnostics
from grpo_core.diagnostics.watchdog import arm_stack_dumps
from grpo_core.models.bridge import gather_hf_weights
from grpo_core.models.shape import ModelShape
from grpo_core.rollout import to_rollout_batch
from grpo_core.tracking import Tracker
from grpo_core.trainer import metrics as M
from grpo_core.trainer.advantages import advantages, rollout_corr_step_metrics, rollout_correction
from grpo_core.trainer.rollouts import draw_rollouts, sampling_metrics, shaped_baselines, shaped_scores, validate
from grpo_core.trainer.setup import TrainingSetup, engine_is_the_actor, needs_ref, set_up
from grpo_core.trainer.stop import StopRequest

logger = logging.getLogger(__name__)


NO_SIGNAL = (
    "step %d: every prompt's responses got the same reward, so every GRPO advantage is 0 and the step changes "
    "nothing (batch/groups_with_signal = 0; said once). Remedies: a longer data.max_response_length (a cut-off "
    "answer scores 0), a reward for the format alone (reward_model.format_score), more responses per prompt "
    "(rollout.n) or a higher temperature, or prompts the model can already solve sometimes"
)
STOPPED = "%s: stopped after step %d of %d, its checkpoint saved"
SHORT_STEP = (
    "step %d: %d of data.train_batch_size=%d prompt groups had a signal after algorithm.filter_groups."
    "max_num_gen_batches=%d batches; the step trains on those (with none, on the last batch, which changes "
    "nothing; said once). The prompts may be too hard or too easy for the model: raise max_num_gen_batches "
    "(0: no limit), rollout.n or the temperature"
)


def train(cfg: GRPOConfig, shape: ModelShape) -> dict[str, float]:
    """Run the configured number of steps (resuming if a checkpoint is there); the last step's metrics."""
    arm_stack_dumps()  # the launcher's hang watchdog asks for every thread's stack (diagnostics/watchdog.py)
    setup = set_up(cfg, shape)
    stop = StopRequest()  # SIGTERM during set-up kills (nothing to save yet); from here on it stops after a step
    try:
        stop.install()
        start_step, position = resume(setup)  # position: prompt batches drawn so far (dynamic sampling: several a step)
        tracker = Tracker(cfg, enabled=setup.rank == 0, start_step=start_step)
        diag = RunDiagnostics(cfg, shape, setup.rank, tracker)  # GPU use, profiles, advice on errors
        tracker.log_params(to_flat_dict(cfg))
        if setup.dropped:
            logger.warning("dropped %d training prompts longer than data.max_prompt_length", setup.dropped)
        if cfg.trainer.val_before_train and setup.val_prompts:
            tracker.log(validate(cfg, setup.engine, setup.val_prompts, setup.tokenizer, setup.scorer), step=start_step)
        # Models, engine and libraries live for the whole run: keep full collections off them (perf/gc_s).
        gc.collect()
        gc.freeze()
        step_metrics: dict[str, float] = {}
        total = setup.total_steps
        for step in tracker.progress(range(start_step, total), total=total, start=start_step):
            step_metrics, position = grpo_step(setup, diag, step, position)
            last = step + 1 == total
            stopping = stop.agreed()  # every rank stops after the same step
            if setup.val_prompts and cfg.trainer.test_freq > 0 and ((step + 1) % cfg.trainer.test_freq == 0 or last):
                step_metrics |= validate(cfg, setup.engine, setup.val_prompts, setup.tokenizer, setup.scorer)
            tracker.log(step_metrics, step=step + 1)
            if setup.checkpoints.should_save(step + 1, last or stopping is not None):
                seen = sorted(setup.sampler.seen | setup.sampler.drawn(position))  # the export lists them too
                state = {**setup.trainer_state, "data_position": position, "rows_seen": seen}
                setup.checkpoints.save(step + 1, setup.actor, state, setup.save_contents)
            if stopping is not None and not last:
                if setup.rank == 0:
                    logger.warning(STOPPED, stopping, step + 1, total)
                break
        tracker.close()
        diag.close()
        return step_metrics
    finally:
        gc.unfreeze()  # a pipeline runs train in-process: its models must be collectable afterwards
        stop.restore()
        if setup.engine is not None and hasattr(setup.engine, "close"):
            setup.engine.close()  # vLLM's engine processes do not end with this one


def resume(setup: TrainingSetup) -> tuple[int, int]:
    """(first step, data position) from the checkpoint to resume from, if any, else (0, 0); then the engine
    gets the actor's weights if it does not hold them yet."""
    # rank 0 verifies (reads every file once) and picks; the others take its choice
    choice = [setup.checkpoints.resolve_resume(setup.cfg.trainer.resume_mode) if setup.rank == 0 else None]
    dist.broadcast_object_list(choice, src=0)
    resume_from = choice[0]
    start_step = position = 0
    if resume_from is not None:
        check_same_data(resume_from, setup.trainer_state["data"])  # `grpo train` checked it too, before any rank
        resumed = setup.checkpoints.load(resume_from, setup.actor, setup.load_contents)
        start_step, position = resumed["step"], resumed.get("data_position", resumed["step"])
    if resume_from is not None or _engine_starts_empty(setup.cfg):
        sync_weights(setup.actor, setup.engine, setup.shape, setup.cfg)  # the engine holds the initial weights, or none
    return start_step, position


def grpo_step(setup: TrainingSetup, diag: RunDiagnostics, step: int, position: int) -> tuple[dict[str, float], int]:
    """Step ``step`` (from 0), its prompts from data position ``position`` on: generate and score -> old and
    reference log-probs -> advantages -> update -> weight sync. Its metrics, and the data position after it."""
    cfg, actor, engine = setup.cfg, setup.actor, setup.engine
    timings: dict[str, float] = {}
    started = time.perf_counter()
    M.reset_peak_memory()
    diag.begin_step(step + 1)

    engine_timings = getattr(engine, "take_timings", dict)  # the static engine's parts of the gen phase
    engine_timings()  # drop what validation's generation left
    with timed(timings, "gen", diag):
        drawn = draw_rollouts(engine, setup.sampler, position, setup.sampling, setup.tokenizer, cfg, setup.scorer)
        if engine is not None and cfg.actor_rollout_ref.rollout.free_cache_engine:
            engine.sleep()
    gen_parts = engine_timings()
    rollouts, wanted = drawn.rollouts, cfg.data.train_batch_size
    if drawn.groups_kept < wanted:
        fg = cfg.algorithm.filter_groups
        say_once(setup, SHORT_STEP, step + 1, drawn.groups_kept, wanted, fg.max_num_gen_batches)
    batch = to_rollout_batch(rollouts.gen, setup.tokenizer.pad_token_id)

    reused, later = old_and_ref_log_probs(setup, batch, timings, diag)
    scores, shaping_metrics = shaped_scores(rollouts, cfg)
    if drawn.groups_with_signal == 0:
        say_once(setup, NO_SIGNAL, step + 1)
    baselines = shaped_baselines(rollouts, cfg)
    batch.advantages = advantages(scores, batch, rollouts.gen.group_index, cfg, baselines)
    trained, correction_metrics = rollout_correction(batch, cfg)
    with timed(timings, "update", diag):
        update_metrics, entropy = update_actor(actor, trained, reused, later)
    batch.old_log_probs = trained.old_log_probs  # the update's first forward may have given them
    with timed(timings, "sync", diag):
        sync_and_offload(setup)
    # the whole step's wall time, the host's work between the phases (the batch, rewards, advantages) with it
    timings["step"] = time.perf_counter() - started

    rc = cfg.algorithm.rollout_correction
    step_metrics = {
        **M.rollout_metrics(
            rollouts.gen, rollouts.scores, batch, cfg.reward_model.score, cfg.reward_model.format_score
        ),
        **shaping_metrics,
        **M.baseline_metrics(rollouts.baseline_scores, rollouts.scores, rollouts.gen.group_index),
        "batch/groups_with_signal": drawn.groups_with_signal,
        **sampling_metrics(drawn, cfg),
        **M.log_prob_metrics(batch, entropy),
        **M.rollout_correction_metrics(batch, rc.rollout_is, rc.rollout_is_threshold),
        **correction_metrics,
        **rollout_corr_step_metrics(batch, trained, cfg),
        **update_metrics,
        **M.timing_metrics(timings),
        **gen_parts,
        **M.throughput_metrics(batch, timings, setup.shape, dist.get_world_size()),
        "perf/old_log_prob_tokens": float(batch.attention_mask[reused:].sum()),
        **diag.end_step(step + 1),
    }
    return step_metrics, position + drawn.gen_batches


# ---- one step's parts ---------------------------------------------------------------------------------


@contextmanager
def timed(timings: dict[str, float], name: str, diag: RunDiagnostics | None = None):
    """Wall seconds of a phase; synchronises the GPU first so queued kernels are not counted later.
    ``diag`` tags GPU samples and the profile with the phase, and explains an error raised in it."""
    start = time.perf_counter()
    with diag.phase(name) if diag is not None else nullcontext():
        yield
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    timings[name] = timings.get(name, 0.0) + time.perf_counter() - start


def say_once(setup: TrainingSetup, message: str, *args) -> None:
    """Warn, on rank 0, the first time in the run that ``message`` applies: it would say the same each step."""
    if setup.rank == 0 and message not in setup.said:
        logger.warning(message, *args)
        setup.said.add(message)


def old_and_ref_log_probs(
    setup: TrainingSetup, batch: RolloutBatch, timings: dict[str, float], diag: RunDiagnostics
) -> tuple[int, tuple[torch.Tensor, torch.Tensor] | None]:
    """Fill in ``batch``'s old log-probs, but for the first ``reused`` rows, which the update's first forward gives
    (``MegatronActor.update_on_policy``), and its reference log-probs. (reused, the later rows' (log-probs,
    entropy) or None)."""
    arr = setup.cfg.actor_rollout_ref
    reused = min(batch.batch_size, _on_policy_rows(setup.cfg))
    later = None
    if reused < batch.batch_size:
        with timed(timings, "old_log_prob", diag):
            later = setup.actor.compute_log_prob(batch.rows(slice(reused, None)), **log_prob_batching(arr.rollout))
        if not reused:
            batch.old_log_probs = later[0]
    if setup.ref is not None:
        with timed(timings, "ref", diag):
            batch.ref_log_probs, _ = setup.ref.compute_log_prob(batch, **log_prob_batching(arr.ref))
            if arr.ref.megatron.param_offload:
                setup.ref.offload_to_host(params=True)
    elif needs_ref(setup.cfg):  # LoRA: the reference is the base model, the actor with its adapters off
        with timed(timings, "ref", diag):
            batch.ref_log_probs, _ = setup.actor.compute_log_prob(batch, **log_prob_batching(arr.ref), base=True)
    return reused, later


def update_actor(
    actor: MegatronActor, batch: RolloutBatch, reused: int, later: tuple[torch.Tensor, torch.Tensor] | None
) -> tuple[dict[str, float], torch.Tensor]:
    """The update's metrics, and the entropy of the policy that sampled: from the update's first forward when it
    gives the first ``reused`` rows' old log-probs, else from the old-log-prob pass (``later``)."""
    if reused:
        update_metrics, batch.old_log_probs, entropy = actor.update_on_policy(batch, later)
        return update_metrics, entropy
    return actor.update(batch), later[1]


def sync_and_offload(setup: TrainingSetup) -> None:
    """Wake the engine and give it the updated weights; move to the host what ``actor.megatron`` offloads."""
    engine, actor = setup.engine, setup.actor
    if engine is not None and setup.cfg.actor_rollout_ref.rollout.free_cache_engine:
        engine.wake()
    sync_weights(actor, engine, setup.shape, setup.cfg)
    m = setup.cfg.actor_rollout_ref.actor.megatron
    actor.offload_to_host(params=m.param_offload, grads=m.grad_offload, optimizer=m.optimizer_offload)


def sync_weights(actor: MegatronActor, engine, shape: ModelShape, cfg: GRPOConfig) -> None:
    """Stream the actor's weights, as full HF tensors, into this rank's engine (every rank takes part)."""
    if engine_is_the_actor(cfg):
        return
    _, tensors = gather_hf_weights(actor.model, shape, dtype=cfg.actor_rollout_ref.rollout.dtype, dst=None)
    if engine is not None:
        engine.update_weights(tensors)
    for _ in tensors:  # ranks without an engine (and an engine that stopped early) still join every transfer
        pass


def _engine_starts_empty(cfg: GRPOConfig) -> bool:
    """The static engine is built without weights: the actor's (already loaded) are pushed into it."""
    return cfg.actor_rollout_ref.rollout.name == "static"


def log_prob_batching(section) -> dict:
    """``compute_log_prob``'s micro-batching from ``rollout`` (old log-probs) or ``ref``: rows, or a token
    budget with ``log_prob_use_dynamic_bsz``."""
    tokens = section.log_prob_max_token_len_per_gpu if section.log_prob_use_dynamic_bsz else None
    return {"micro_batch_rows": section.log_prob_micro_batch_size_per_gpu, "micro_batch_tokens": tokens}


def _on_policy_rows(cfg: GRPOConfig) -> int:
    """Rows of a step whose old log-probs need no separate pass: the first mini-batch's, whose update starts from
    the policy that sampled them; none when something reads the old log-probs before the update (a KL penalty
    in the reward)."""
    rc = cfg.algorithm.rollout_correction
    if cfg.algorithm.use_kl_in_reward or rc.rollout_rs is not None or rc.rollout_is_batch_normalize or rc.bypass_mode:
        return 0  # rollout correction over the whole batch reads them too
    return cfg.actor_rollout_ref.actor.ppo_mini_batch_size * cfg.actor_rollout_ref.rollout.n
