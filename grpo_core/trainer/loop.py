"""The GRPO training loop, run by every torchrun process: rollout -> reward -> advantage -> update -> sync.

Read ``train`` top to bottom: ``set_up`` (models, engine, data), ``resume`` (from a checkpoint, if any),
then one ``grpo_step`` per step, each followed by validation, logging and the checkpoint when they are due.
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
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from grpo_core import actor as _cpu_compat  # noqa: F401  (must precede megatron)
from grpo_core.actor.actor import ActorSettings, MegatronActor
from grpo_core.actor.parallel import init_model_parallel
from grpo_core.algos import (
    draw_again,
    filter_metric_values,
    get_adv_estimator,
    groups_with_spread,
    kl_penalty,
    overlong_penalty,
    rollout_corr_metrics,
    rollout_is_weights,
    rollout_rejection_mask,
    trainable_groups,
)
from grpo_core.config import GRPOConfig, to_flat_dict
from grpo_core.cpu_memory import keep_freed_memory
from grpo_core.data.batch import RolloutBatch
from grpo_core.data.prompts import (
    Prompt,
    PromptSampler,
    decode_responses,
    load_prompts,
    position_data,
    start_rows_seen,
)
from grpo_core.diagnostics import RunDiagnostics
from grpo_core.launch.watchdog import arm_stack_dumps
from grpo_core.models.bridge import gather_hf_weights
from grpo_core.models.shape import ModelShape, hf_overrides, model_weights_dir, read_hf_config, with_overrides
from grpo_core.numerics import NotFinite, first_non_finite
from grpo_core.planning.layout import actor_layout
from grpo_core.quiet import SET_UP
from grpo_core.rewards import Scorer, build_scorer, reward_name
from grpo_core.rollout import Generation, SamplingSettings, build_engine, draw, to_rollout_batch
from grpo_core.rollout.hf import load_tokenizer
from grpo_core.tracking import Tracker
from grpo_core.trainer import metrics as M
from grpo_core.trainer.checkpoint import CheckpointManager, check_same_data, contents_setting
from grpo_core.trainer.stop import StopRequest

logger = logging.getLogger(__name__)


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


@dataclass
class TrainingSetup:
    """What set-up builds and every step uses: the models, this rank's rollout engine, the data, the reward."""

    cfg: GRPOConfig
    shape: ModelShape
    rank: int
    actor: MegatronActor
    ref: MegatronActor | None  # frozen initial policy, for a KL loss or a KL penalty in the reward (not with LoRA)
    engine: object | None  # this rank's rollout engine (None: this rank only joins the gathers and syncs)
    tokenizer: object
    sampler: PromptSampler
    dropped: int  # training prompts dropped as longer than data.max_prompt_length
    val_prompts: list[Prompt]
    scorer: Scorer
    sampling: SamplingSettings
    total_steps: int
    checkpoints: CheckpointManager
    save_contents: frozenset
    load_contents: frozenset
    trainer_state: dict  # what every checkpoint records besides the weights (and the data position)
    said: set[str] = field(default_factory=set)  # the once-a-run warnings given so far


def train(cfg: GRPOConfig, shape: ModelShape) -> dict[str, float]:
    """Run the configured number of steps (resuming if a checkpoint is there); the last step's metrics."""
    arm_stack_dumps()  # the launcher's hang watchdog asks for every thread's stack (launch/watchdog.py)
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


def set_up(cfg: GRPOConfig, shape: ModelShape) -> TrainingSetup:
    """Parallel state, tokenizer, prompts, reward, actor (and ref) with their initial weights, rollout engine."""
    arr, model_cfg = cfg.actor_rollout_ref, cfg.actor_rollout_ref.model
    started = time.perf_counter()
    if cfg.trainer.device == "cpu":
        keep_freed_memory()
    layout = actor_layout(cfg)
    init_model_parallel(layout, seed=arr.actor.megatron.seed, timeout_s=arr.nccl_timeout)
    rank = dist.get_rank()

    def status(what: str) -> None:
        if rank == 0:
            logger.info("%s%s (%.0f s)", SET_UP, what, time.perf_counter() - started)

    status(f"loading the tokenizer and data of {model_cfg.path}")

    # Model files: rank 0 downloads from the hub (if not local) while the others wait for the cache.
    if rank != 0:
        dist.barrier()
    model_dir = model_weights_dir(model_cfg.path)
    tokenizer_dir = model_weights_dir(model_cfg.tokenizer_path) if model_cfg.tokenizer_path else model_dir
    if rank == 0:
        dist.barrier()
    tokenizer = load_tokenizer(str(tokenizer_dir), model_cfg.trust_remote_code)

    d = cfg.data
    train_prompts, dropped = load_prompts(
        d.train_files, tokenizer, d.max_prompt_length, d.filter_overlong_prompts, d.truncation, prompt_key=d.prompt_key
    )
    val_prompts = []
    if _validates(cfg):
        val_prompts = load_prompts(d.val_files, tokenizer, d.max_prompt_length, prompt_key=d.prompt_key)[0]
    adapter = model_cfg.lora.start  # a PEFT adapter the adapters start from (else their init)
    seen = start_rows_seen(model_dir, adapter)  # rows the start model's training drew: they come after the others
    sampler = PromptSampler(train_prompts, d.train_batch_size, d.shuffle, d.seed, seen)
    if seen and rank == 0:
        new, rows = sampler.new_rows, len(train_prompts)
        logger.info("%d of the %d training rows are new to the start model: first in every epoch", new, rows)
    scorer = build_scorer(cfg)
    total_steps = cfg.trainer.total_training_steps or sampler.steps_per_epoch * cfg.trainer.total_epochs
    optimizer_steps = total_steps * arr.actor.ppo_epochs * (d.train_batch_size // arr.actor.ppo_mini_batch_size)

    settings = ActorSettings.from_config(cfg, layout, arr.actor.optim.total_training_steps or optimizer_steps)
    status(f"building the actor ({layout.describe()}) and loading its weights")
    actor = MegatronActor(shape, settings, hf_path=str(model_dir), adapter_path=adapter)
    # with LoRA the reference is the actor with its adapters off: no second model
    needs_model = _needs_ref(cfg) and not settings.lora.enabled
    ref = MegatronActor(shape, settings, hf_path=str(model_dir), trainable=False) if needs_model else None
    rollout_tp = arr.rollout.tensor_model_parallel_size
    on_rank = rank % rollout_tp == 0 or _engine_is_the_actor(cfg)
    status(f"building the {arr.rollout.name} rollout engine")
    engine = build_engine(cfg, shape, str(model_dir), tokenizer, actor) if on_rank else None
    status(f"ready; step 1 of {total_steps} starts (the first may take longer: it compiles kernels)")
    # rollout.seed decides what is sampled, on every rank alike (rollout TP ranks must draw the same tokens): the
    # static and HF engines draw from torch's default generators, which megatron seeded with actor.megatron.seed;
    # vLLM's and megatron's engines take it as their own. A resumed run then restores the generators it saved.
    torch.manual_seed(arr.rollout.seed)

    trainer_state = {
        "hf_config": with_overrides(read_hf_config(str(model_dir)), hf_overrides(model_cfg.override_config)),
        "dtype": settings.dtype,
        "tokenizer_path": str(tokenizer_dir),
        # what the data position counts in: the training set, and the rows its start model had seen
        "data": {**position_data(d.train_files, model_dir, adapter), "rows": len(train_prompts)},
    }
    if settings.lora.enabled:  # a LoRA checkpoint holds adapters: it names the base they belong to
        trainer_state["lora"] = {**settings.lora.record(), "base_model": model_cfg.path}
    save_contents, load_contents = contents_setting(arr.actor.checkpoint)
    return TrainingSetup(
        cfg=cfg,
        shape=shape,
        rank=rank,
        actor=actor,
        ref=ref,
        engine=engine,
        tokenizer=tokenizer,
        sampler=sampler,
        dropped=dropped,
        val_prompts=val_prompts,
        scorer=scorer,
        sampling=rollout_sampling(cfg),
        total_steps=total_steps,
        checkpoints=CheckpointManager.for_run(cfg.trainer),
        save_contents=save_contents,
        load_contents=load_contents,
        trainer_state=trainer_state,
    )


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
    elif _needs_ref(setup.cfg):  # LoRA: the reference is the base model, the actor with its adapters off
        with timed(timings, "ref", diag):
            batch.ref_log_probs, _ = setup.actor.compute_log_prob(batch, **log_prob_batching(arr.ref), base=True)
    return reused, later


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


def advantages(
    scores: list[float],
    batch: RolloutBatch,
    group_index: list[int],
    cfg: GRPOConfig,
    baselines: list[float] | None = None,
) -> torch.Tensor:
    """Each response token's advantage, [B, R]: ``algorithm.adv_estimator`` over the outcome rewards (``scores`` on
    the last tokens), less the KL penalty with ``algorithm.use_kl_in_reward``. ``baselines``: remax's, one per
    prompt."""
    token_rewards = token_level_rewards(scores, batch.response_mask)
    if cfg.algorithm.use_kl_in_reward:
        kl = kl_penalty(batch.old_log_probs, batch.ref_log_probs, cfg.algorithm.kl_penalty)
        token_rewards = token_rewards - cfg.algorithm.kl_ctrl.kl_coef * kl * batch.response_mask
    options = advantage_options(cfg)
    if baselines is not None:
        options["reward_baselines"] = torch.tensor([baselines[g] for g in group_index], dtype=token_rewards.dtype)
    estimate, _ = get_adv_estimator(cfg.algorithm.adv_estimator)(
        token_rewards, batch.response_mask, index=group_index, **options
    )
    return estimate


def rollout_correction(batch: RolloutBatch, cfg: GRPOConfig) -> tuple[RolloutBatch, dict[str, float]]:
    """The batch the update trains on, and the rejection metrics (``rollout_corr/rollout_rs_*``). Bypass mode: the
    engine's log-probs are the old policy's (bypass_mode's loss then weighs and rejects per micro-batch, as verl's
    does). Decoupled: rejection sampling drops tokens from the loss mask, and batch-normalised weights are computed
    here over the whole batch (both need every row's old log-probs: ``_on_policy_rows`` is then 0); plain weights
    are computed per micro-batch by the loss."""
    rc = cfg.algorithm.rollout_correction
    if rc.bypass_mode:
        return replace(batch, old_log_probs=batch.rollout_log_probs), {}
    if rc.rollout_rs is None and not (rc.rollout_is is not None and rc.rollout_is_batch_normalize):
        return batch, {}
    old, engine = batch.old_log_probs, batch.rollout_log_probs
    trained, metrics = batch, {}
    if rc.rollout_rs is not None:
        kept, rs_metrics = rollout_rejection_mask(
            old, engine, batch.response_mask, rc.rollout_rs, rc.rollout_rs_threshold
        )
        trained = replace(trained, response_mask=kept)
        metrics = {f"rollout_corr/{k}": v for k, v in rs_metrics.items()}
    if rc.rollout_is is not None and rc.rollout_is_batch_normalize:
        mask = trained.response_mask
        weights = rollout_is_weights(old, engine, mask, rc.rollout_is, rc.rollout_is_threshold, batch_normalize=True)
        trained = replace(trained, rollout_is_weights=weights)
    return trained, metrics


def rollout_corr_step_metrics(batch: RolloutBatch, trained: RolloutBatch, cfg: GRPOConfig) -> dict[str, float]:
    """verl's ``rollout_corr/*`` of the weights the update used (when rollout_is is on) and of the mismatch between
    the engine and the old policy, over the tokens the update trained on; none in bypass mode (old is the engine)."""
    rc = cfg.algorithm.rollout_correction
    if rc.bypass_mode or (rc.rollout_is is None and rc.rollout_rs is None) or batch.rollout_log_probs is None:
        return {}
    old, engine, mask = batch.old_log_probs, batch.rollout_log_probs, trained.response_mask
    weights = trained.rollout_is_weights
    if weights is None and rc.rollout_is is not None:
        weights = rollout_is_weights(old, engine, mask, rc.rollout_is, rc.rollout_is_threshold)
    level = rc.rollout_is or "token"
    return rollout_corr_metrics(
        weights,
        old,
        engine,
        mask,
        rc.rollout_is_threshold,
        level,
        rc.rollout_is is not None and rc.rollout_is_batch_normalize,
    )


def advantage_options(cfg: GRPOConfig) -> dict:
    """The keyword options every advantage estimator is called with; each takes those it uses."""
    algo = cfg.algorithm
    return {"norm_adv_by_std_in_grpo": algo.norm_adv_by_std_in_grpo, "gamma": algo.gamma, "lam": algo.lam}


def token_level_rewards(scores: list[float], response_mask: torch.Tensor) -> torch.Tensor:
    """Each response's score on its last token (outcome reward), zeros elsewhere: [B, R]."""
    rewards = torch.zeros(response_mask.shape, dtype=torch.float32)
    last = (response_mask.sum(-1) - 1).clamp(min=0)
    rewards[torch.arange(len(scores)), last] = torch.tensor(scores, dtype=torch.float32)
    return rewards * response_mask


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
    if _engine_is_the_actor(cfg):
        return
    _, tensors = gather_hf_weights(actor.model, shape, dtype=cfg.actor_rollout_ref.rollout.dtype, dst=None)
    if engine is not None:
        engine.update_weights(tensors)
    for _ in tensors:  # ranks without an engine (and an engine that stopped early) still join every transfer
        pass


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


def _validates(cfg: GRPOConfig) -> bool:
    return cfg.trainer.val_before_train or cfg.trainer.test_freq > 0


def _engine_is_the_actor(cfg: GRPOConfig) -> bool:
    """The megatron engine generates with the actor's model: on every rank, with nothing to sync."""
    return cfg.actor_rollout_ref.rollout.name == "megatron"


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


def _needs_ref(cfg: GRPOConfig) -> bool:
    return cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
