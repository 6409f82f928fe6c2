"""`grpo train --dry-run`: the guide's command lines pass; invalid configurations exit 2 with one clear
message each and no traceback."""

import re
import shlex
import shutil
import subprocess
import sys

import pytest

from grpo_core.cli import main
from tests.conftest import REPO

BASE = str(REPO / "configs" / "grpo_base.yaml")
MEGA = "actor_rollout_ref.actor.megatron."
OPTIM = "actor_rollout_ref.actor.optim."

GUIDE_COMMANDS = [
    f"--config {BASE} --dry-run",
    f"--config {BASE} algorithm.adv_estimator=grpo {MEGA}tensor_model_parallel_size=2 "
    f"{MEGA}pipeline_model_parallel_size=2 actor_rollout_ref.rollout.tensor_model_parallel_size=2 "
    "algorithm.group_size=5 actor_rollout_ref.actor.kl_coeff=0.001 actor_rollout_ref.actor.use_kl_loss=True "
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl actor_rollout_ref.actor.gradient_clipping=1.0 "
    "trainer.nnodes=1 trainer.n_gpus_per_node=8 --dry-run",
    f"--config {BASE} {MEGA}param_offload=True {MEGA}grad_offload=True {MEGA}optimizer_offload=True "
    f"+{MEGA}override_transformer_config.recompute_granularity=full "
    f"+{MEGA}override_transformer_config.recompute_method=uniform "
    f"+{MEGA}override_transformer_config.recompute_num_layers=1 --dry-run",
    f"--config {BASE} actor_rollout_ref.model.path=Qwen/Qwen2.5-7B-Instruct {MEGA}dtype=float16 "
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 --dry-run",
    f"--config {REPO}/configs/grpo_advanced.yaml --dry-run",
    f"--config {REPO}/configs/grpo_megatron_large.yaml --dry-run",
    f"--config {REPO}/configs/demo_cpu.yaml --dry-run",
    f"--config {REPO}/configs/dapo_qwen2_5_7b.yaml --dry-run",
    f"--config {REPO}/configs/gspo_qwen3_30b_a3b.yaml --dry-run",
    f"--config {BASE} actor_rollout_ref.model.path=meta-llama/Llama-3.1-8B trainer.nnodes=2 "
    f"{MEGA}tensor_model_parallel_size=4 --dry-run",
    f"--config {BASE} trainer.nnodes=2 launch.launcher=slurm launch.slurm_options=[--partition=gpu] --dry-run",
    f"--config {BASE} actor_rollout_ref.rollout.name=megatron {MEGA}pipeline_model_parallel_size=1 "
    f"{MEGA}sequence_parallel=false --dry-run",
    f"--config {BASE} actor_rollout_ref.actor.use_dynamic_bsz=true "
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=6144 --dry-run",
    # the guide's spelling of the optimizer section
    f"--config {BASE} actor_rollout_ref.actor.optimizer.lr=2e-6 actor_rollout_ref.actor.optimizer.weight_decay=0.1 "
    "--dry-run",
    # the guide's Qwen3-235B-A22B line: TP=8 over 4 KV heads (megatron replicates each KV head on 2 ranks)
    f"--config {REPO}/configs/grpo_megatron_large.yaml {MEGA}tensor_model_parallel_size=8 "
    f"{MEGA}pipeline_model_parallel_size=4 {MEGA}expert_model_parallel_size=8 "
    f"+{MEGA}override_transformer_config.num_layers_in_first_pipeline_stage=22 "
    f"+{MEGA}override_transformer_config.num_layers_in_last_pipeline_stage=22 --dry-run",
    f"--config {BASE} actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true "
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=12288 "
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true "
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=12288 --dry-run",
    # verl's optimizer CPU offload, through megatron's OptimizerConfig
    f"--config {BASE} {MEGA}optimizer_offload=True "
    f"+{OPTIM}override_optimizer_config.optimizer_offload_fraction=1. "
    f"+{OPTIM}override_optimizer_config.overlap_cpu_optimizer_d2h_h2d=True "
    f"+{OPTIM}override_optimizer_config.use_precision_aware_optimizer=True "
    f"+{OPTIM}override_optimizer_config.optimizer_cpu_offload=True --dry-run",
]


@pytest.mark.parametrize("command", GUIDE_COMMANDS)
def test_guide_command_lines_pass(command, capsys):
    assert main(["train", *shlex.split(command)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "dry run OK" in out and "parallel layout:" in out and "phase: update" in out


def test_dry_run_prints_layout_and_memory(capsys):
    assert main(["train", "--config", BASE, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "world=8 TP=2 PP=2 CP=1 DP=2" in out
    for row in ("actor weights", "gradients", "optimizer", "activations", "reference model", "KV-cache"):
        assert row in out
    assert "tensor_model_parallel_size: 2" in out  # the resolved config


MEGATRON_ROLLOUT = [
    "actor_rollout_ref.rollout.name=megatron",
    f"{MEGA}pipeline_model_parallel_size=1",
    f"{MEGA}sequence_parallel=false",
]
INVALID = [
    (
        [f"{MEGA}tensor_model_parallel_size=2", "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=4"],
        "tensor model parallel size mismatch: actor=2, ref=4",
    ),
    (["algorithm.adv_estimator=gae"], "algorithm.adv_estimator=gae: not offered here: GAE, which needs a critic"),
    (["tracking.champion_alpha=0"], "tracking.champion_alpha=0.0 must be in (0, 1]"),
    (
        ["algorithm.adv_estimator=grpoo"],
        "algorithm.adv_estimator='grpoo' is not valid; valid: ['grpo', 'rloo', 'reinforce_plus_plus', ",
    ),
    (
        ["actor_rollout_ref.actor.policy_loss.loss_mode=gsop"],
        "actor_rollout_ref.actor.policy_loss.loss_mode='gsop' is not valid; valid: ['vanilla', 'gspo', 'sapo'",
    ),
    (
        ["algorithm.rollout_correction.rollout_is=geo"],
        "algorithm.rollout_correction.rollout_is='geo' is not valid; valid: [None, 'token', 'sequence']",
    ),
    (
        ["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=0"],
        "algorithm.rollout_correction.rollout_is_threshold=0 must be > 0",
    ),
    (["algorithm.gamma=1.5"], "algorithm.gamma=1.5 must be in [0, 1]"),
    (  # issue 43: the losses' and rollout correction's own settings
        ["actor_rollout_ref.actor.policy_loss.loss_mode=dro"],
        "actor_rollout_ref.actor.policy_loss.dro_beta=None: loss_mode=dro needs a beta > 0",
    ),
    (
        ["algorithm.rollout_correction.rollout_rs=seq_mean_k3"],
        "algorithm.rollout_correction.rollout_rs needs rollout_rs_threshold",
    ),
    (
        [
            "algorithm.rollout_correction.rollout_rs=token_k2",
            "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0",
        ],
        "algorithm.rollout_correction.rollout_rs_threshold '0.5_2.0' for token_k2: one upper bound > 0",
    ),
    (
        ["algorithm.rollout_correction.rollout_is_threshold=2.0_0.5"],
        "algorithm.rollout_correction.rollout_is_threshold='2.0_0.5' must be > 0 (or 'lower_upper' with 0 < lower",
    ),
    (
        ["algorithm.rollout_correction.bypass_mode=true", "actor_rollout_ref.actor.policy_loss.loss_mode=gspo"],
        "bypass_mode=true replaces policy_loss.loss_mode with bypass_mode",
    ),
    (
        ["actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode"],
        "set algorithm.rollout_correction.bypass_mode=true instead",
    ),
    (["algorithm.rollout_correction.loss_type=pg"], "algorithm.rollout_correction.loss_type='pg' is not valid"),
    (["actor_rollout_ref.actor.kl_loss_type=low_var"], "kl_loss_type='low_var' is not valid; valid: ["),
    (["actor_rollout_ref.actor.loss_agg_mode=mean"], "loss_agg_mode='mean' is not valid"),
    (
        ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=accuracy"],
        "algorithm.filter_groups.metric='accuracy' is not valid; valid: ['acc', 'score', 'seq_reward', "
        "'seq_final_reward']",
    ),
    (
        ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=-1"],
        "algorithm.filter_groups.max_num_gen_batches=-1 must be >= 0 (0: no limit)",
    ),
    (["algorithm.group_size=1"], "needs at least 2 per prompt"),
    ([f"{MEGA}tensor_model_parallel_size=3"], "world size 8 is not divisible by TP*PP*CP"),
    (
        [f"{MEGA}tensor_model_parallel_size=8", f"{MEGA}pipeline_model_parallel_size=1"],
        "attention heads (28) are not divisible by TP=8",
    ),
    (["trainer.n_gpus_per_node=6", f"{MEGA}pipeline_model_parallel_size=3"], "layers (28) are not divisible by PP=3"),
    ([f"{MEGA}expert_model_parallel_size=2"], "needs an MoE model"),
    (["data.train_batch_size=1000"], "is not a multiple of actor_rollout_ref.actor.ppo_mini_batch_size=256"),
    (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=7"], "not a multiple of ppo_micro_batch_size_per_gpu=7"),
    (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64"], "exceeds trainer.gpu_memory_gib=80"),
    (
        ["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1000"],
        "ppo_max_token_len_per_gpu=1000 does not hold one sequence of max_prompt_length + max_response_length = 1536",
    ),
    (
        [
            "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=1000",
        ],
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=1000 does not hold one sequence of max_prompt_length",
    ),
    ([f"+{OPTIM}override_optimizer_config.optimizer_ofload_fraction=1."], "did you mean 'optimizer_offload_fraction'"),
    (
        [f"+{OPTIM}override_optimizer_config.no_such_field=1"],
        f"{OPTIM}override_optimizer_config.no_such_field: megatron's OptimizerConfig has no field 'no_such_field'",
    ),
    (["actor_rollout_ref.actor.loss_scale_factor=0"], "actor_rollout_ref.actor.loss_scale_factor=0.0 must be > 0"),
    (["trainer.nnodes=0"], "trainer.nnodes=0 must be >= 1"),
    (["trainer.nnodes=two"], "trainer.nnodes='two' is not a valid int"),
    (["trainer.n_gpu_per_node=8"], "did you mean 'trainer.n_gpus_per_node'"),
    (["trainer.logger=[console,neptune]"], "trainer.logger entry 'neptune' is not valid"),
    (["actor_rollout_ref.rollout.tensor_model_parallel_size=3"], "rollout tensor parallel size 3"),
    (["data.max_response_length=40000"], "exceeds the model's max_position_embeddings"),
    ([f"+{MEGA}override_transformer_config.recompute_granularty=full"], "did you mean 'recompute_granularity'"),
    (["actor_rollout_ref.model.path=./no/such/model"], "no such local directory"),
    (["actor_rollout_ref.rollout.gpu_memory_utilization=0.05"], "cannot hold one 1536-token sequence"),
    (["actor_rollout_ref.actor.clip_ratio_c=1.0"], "clip_ratio_c=1.0 must be > 1"),
    # NaN passes every range check: one rule refuses every non-finite float, nested ones too
    ([f"{OPTIM}lr=nan"], f"{OPTIM}lr=nan: not a finite number (NaN and infinity are refused)"),
    ([f"{OPTIM}lr=inf"], f"{OPTIM}lr=inf: not a finite number"),
    (["actor_rollout_ref.actor.clip_ratio_low=nan"], "actor_rollout_ref.actor.clip_ratio_low=nan: not a finite"),
    (["algorithm.kl_ctrl.kl_coef=-inf"], "algorithm.kl_ctrl.kl_coef=-inf: not a finite number"),
    ([f"+{MEGA}override_transformer_config.hidden_dropout=nan"], "override_transformer_config.hidden_dropout=nan: not"),
    (["trainer.nnodes=2", "launch.rdzv_endpoint=node0"], "launch.rdzv_endpoint='node0' is not HOST:PORT"),
    (["launch.rdzv_endpoint=node0:99999"], "launch.rdzv_endpoint='node0:99999' is not HOST:PORT"),
    (["trainer.nnodes=2", "launch.rdzv_endpoint=n0:29500", "launch.node_rank=2"], "launch.node_rank=2 must be in [0, "),
    (["launch.node_rank=-1"], "launch.node_rank=-1 must be in [0, trainer.nnodes=1)"),
    (["launch.launcher=mpirun"], "launch.launcher='mpirun' is not valid; valid: ['torchrun', 'slurm']"),
    (["launch.stuck_timeout_s=0"], "launch.stuck_timeout_s=0.0 must be > 0"),
    (["trainer.hang_timeout_s=0"], "trainer.hang_timeout_s=0.0 must be > 0 (or null: automatic)"),
    (["tracking.train_retries=-1"], "tracking.train_retries=-1 must be >= 0"),
    # a run directory that cannot be made: refused here, not as a FileExistsError when its lock is taken
    ([f"trainer.default_local_dir={BASE}"], f"trainer.default_local_dir={BASE}: {BASE} is a file, not a directory"),
    ([f"trainer.default_local_dir={BASE}/run"], f"trainer.default_local_dir={BASE}/run: {BASE} is a file, not a"),
    (["actor_rollout_ref.hybrid_engine=false"], "hybrid_engine=false: the actor, reference and rollout engine always"),
    ([MEGATRON_ROLLOUT[0]], "rollout.name=megatron generates with the actor's model: it needs PP=1"),
    (MEGATRON_ROLLOUT[:2], f"set {MEGA}sequence_parallel=false"),
    ([*MEGATRON_ROLLOUT, "actor_rollout_ref.rollout.tensor_model_parallel_size=1"], "rollout TP=1 must be the actor's"),
    ([*MEGATRON_ROLLOUT, f"{MEGA}context_parallel_size=2"], "it needs context parallel size 1, not 2"),
    (
        [*MEGATRON_ROLLOUT, "actor_rollout_ref.rollout.top_k=20", "actor_rollout_ref.rollout.top_p=0.9"],
        "rollout.name=megatron samples with top_k or top_p, not both",
    ),
]


@pytest.mark.parametrize("overrides,message", INVALID, ids=[m for _, m in INVALID])
def test_invalid_configurations_exit_2(overrides, message, capsys):
    assert main(["train", "--config", BASE, *overrides, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err
    assert "nothing was started" in err


GSPO_TOKEN_MEAN = "policy_loss.loss_mode=gspo with loss_agg_mode=token-mean"
FAMILY = [  # (overrides, what the dry run says: a note or a warning, or None)
    (["algorithm.adv_estimator=rloo"], None),
    (["algorithm.adv_estimator=reinforce_plus_plus", "algorithm.gamma=0.99"], None),
    (["algorithm.gamma=0.99"], "note: algorithm.gamma=0.99: no effect with adv_estimator=grpo"),
    (["algorithm.lam=0.95"], "note: algorithm.lam=0.95: no effect here: GAE's lambda"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=gspo"], f"warning: {GSPO_TOKEN_MEAN}"),
    (
        [
            "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
            "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
        ],
        None,
    ),
    (["algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=10"], None),
    (  # DAPO scripts size their generation batches; here every batch is train_batch_size prompts
        ["algorithm.filter_groups.enable=true", "data.gen_batch_size=1536"],
        "note: data.gen_batch_size: no effect here: prompts are generated data.train_batch_size at a time",
    ),
    (
        ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_final_reward"],
        "note: algorithm.filter_groups.metric=seq_final_reward: no shaping is on",
    ),
    (["algorithm.rollout_correction.rollout_is=token"], None),
    (["algorithm.rollout_correction.rollout_is=sequence", "algorithm.rollout_correction.rollout_is_threshold=5"], None),
]


@pytest.mark.parametrize("overrides,said", FAMILY, ids=[" ".join(o) for o, _ in FAMILY])
def test_the_grpo_family_keys_pass_with_their_notes(overrides, said, capsys):
    """Issue 16: rloo, reinforce_plus_plus, gspo and rollout importance sampling are settings, not refusals;
    gamma and lam are noted where no estimator uses them, GSPO with a token-level aggregation is warned about."""
    assert main(["train", "--config", BASE, *overrides, "--dry-run"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "dry run OK" in out
    for line in ("note: algorithm.gamma", "note: algorithm.lam", f"warning: {GSPO_TOKEN_MEAN}"):
        assert (line in out) == (said is not None and said.startswith(line)), line
    if said is not None:
        assert said in out


def test_token_budgets_with_pipeline_stages_on_unpacked_rows_take_whole_rows(capsys):
    """Token budgets with PP on unpacked rows (use_remove_padding=false, or CP > 1): a note says every micro-batch
    holds one number of whole rows (actor.rows_in_budget), where they were refused before."""
    keys = ["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true"]
    code = main(["train", "--config", BASE, *keys, "actor_rollout_ref.model.use_remove_padding=false", "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0 and "dry run OK" in out
    for key in ("actor.use_dynamic_bsz", "ref.log_prob_use_dynamic_bsz"):
        assert f"note: actor_rollout_ref.{key} with pipeline parallelism and unpacked rows" in out


def test_filter_groups_metric_must_be_one_the_reward_produces(tmp_path, capsys):
    """A custom reward reports its score alone: filtering on accuracy is refused, on the score accepted."""
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.5\n")
    common = ["--config", BASE, f"custom_reward_function.path={reward}", "algorithm.filter_groups.enable=true"]
    assert main(["train", *common, "--dry-run"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "algorithm.filter_groups.metric=acc needs a reward that reports accuracy" in errors[0]
    assert main(["train", *common, "algorithm.filter_groups.metric=score", "--dry-run"]) == 0
    assert main(["train", *common[:3], "--dry-run"]) == 0  # acc is the default metric: only checked when on


def test_a_process_exits_2_without_a_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  nnodes: [\n")
    for args in (
        ["--config", str(bad)],
        ["--config", str(tmp_path / "none.yaml")],
        ["algorithm.group_size=1"],
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "grpo_core.main_ppo", *args, "--dry-run"],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=120,
        )
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr


def test_multi_node_torchrun_without_a_rendezvous_warns_in_a_dry_run_and_is_refused_by_train(capsys):
    message = "trainer.nnodes=2 with launch.launcher=torchrun needs launch.rdzv_endpoint=HOST:PORT"
    assert main(["train", "--config", BASE, "trainer.nnodes=2", "--dry-run"]) == 0
    assert message in capsys.readouterr().out
    assert main(["train", "--config", BASE, "trainer.nnodes=2"]) == 2  # before it looks for the data
    err = capsys.readouterr().err
    assert f"error: {message}" in err and "Traceback" not in err


def test_warnings_do_not_fail(capsys):
    assert main(["train", "--config", BASE, "algorithm.group_size=16", "--dry-run"]) == 0
    assert "outside the guide's 5-10" in capsys.readouterr().out


def test_an_override_that_undoes_optimizer_offload_warns(capsys):
    args = [f"{MEGA}optimizer_offload=true", f"+{OPTIM}override_optimizer_config.optimizer_offload_fraction=0.5"]
    assert main(["train", "--config", BASE, *args, "--dry-run"]) == 0
    assert "optimizer_offload=true is overridden by" in capsys.readouterr().out


LORA_64 = [f"actor_rollout_ref.model.lora.{k}" for k in ("rank=64", "alpha=128", "target_modules=all-linear")]


def test_a_checkpoint_that_cannot_fit_the_disk_is_refused_before_the_run(capsys):
    """The dry run compares a checkpoint's size (weights, + 12 B a parameter of Adam's state) with the free space
    where it would be written: a real small filesystem, /dev/shm (tmpfs, bounded by the machine's memory)."""
    free = shutil.disk_usage("/dev/shm").free / 1e9
    if not 15.3 < free < 45:  # a 7B's weights fit once but not three times, Adam's state not at all
        pytest.skip(f"/dev/shm has {free:.1f} GB free here")
    args = [
        "actor_rollout_ref.model.path=Qwen/Qwen2.5-7B",
        "trainer.device=cpu",
        "trainer.default_local_dir=/dev/shm/x",
    ]
    assert main(["train", "--config", BASE, *args, "--dry-run"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: a checkpoint of this run takes ~106.6 GB, more than")
    assert errors[0].endswith("leaves Adam's state out (15.2 GB a checkpoint; a resume then starts Adam afresh)")
    lean = "actor_rollout_ref.actor.checkpoint.save_contents=[model,extra]"
    assert main(["train", "--config", BASE, *args, lean, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "warning: 3 checkpoints of ~15.2 GB (trainer.max_actor_ckpt_to_keep=2, and the one being saved)" in out
    assert main(["train", "--config", BASE, *args, lean, "trainer.max_actor_ckpt_to_keep=null", "--dry-run"]) == 0
    assert "checkpoints of" not in capsys.readouterr().out
    with_hf = "actor_rollout_ref.actor.checkpoint.save_contents=[model,extra,hf_model]"  # the weights twice
    main(["train", "--config", BASE, *args, with_hf, "--dry-run"])
    assert "~30.5 GB" in "".join(capsys.readouterr())  # an error or a warning, by what is free
    # LoRA rank 64 on every linear: the checkpoint holds the 142.2M adapter parameters, 2 B + Adam's 12 B each
    # (1.99 GB; the H100 run of bench/lora_vs_trl.sh saved 1.99 GB), not the frozen base
    assert main(["train", "--config", BASE, *args, *LORA_64, "--dry-run"]) == 0
    out = "".join(capsys.readouterr())
    assert "checkpoint of this run" not in out and "checkpoints of" not in out


def test_host_memory_of_the_cpu_optimizer_is_checked(capsys):
    # Qwen2.5-7B, one GPU, 3/4 of Adam on the CPU, reference offloaded: on the H200 node (125 GiB of host memory)
    # the kernel killed this run in its first update. Megatron's CPU optimizer: 0.75 x 7.62e9 x (8 B pinned per
    # tensor, rounded up to powers of two: x1.886, + Adam's 8 B) = 123 GiB; + the optimizer's GPU side between
    # updates (fp32 master 28.4 + Adam 0.25 x 56.8) + the reference 14.2.
    args = [
        "actor_rollout_ref.model.path=Qwen/Qwen2.5-7B",
        "trainer.host_memory_gib=125",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        f"{MEGA}optimizer_offload=true",
        "actor_rollout_ref.ref.megatron.param_offload=true",
        f"+{OPTIM}override_optimizer_config.optimizer_offload_fraction=0.75",
    ]
    one_gpu = str(REPO / "configs" / "smollm2_gsm8k_gpu.yaml")  # one H200 (140 GiB), bf16
    assert main(["train", "--config", one_gpu, *args, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "estimated 180 GiB of host memory per node" in err and "exceeds 90% of the node's 125 GiB" in err
    # the same on a node with 256 GiB, saving each rank's optimizer shards: the table shows the figure
    per_rank = f"{MEGA}dist_ckpt_optim_fully_reshardable=false"
    assert main(["train", "--config", one_gpu, *args, "trainer.host_memory_gib=256", per_rank, "--dry-run"]) == 0
    assert "host memory per node" in capsys.readouterr().out
    # The hybrid optimizer asked for through override_optimizer_config, optimizer_offload off: its GPU side stays
    # on the GPU and the host holds 0.5 x 7.62e9 x (8 B x 1.886 + 8 B) = 81.9 GiB + the reference 14.2 = 96 GiB
    # (measured on the H200 node, bench/one_gpu_7b.sh: ~82 GB pinned, the reference's copy then per tensor too,
    # and ~34 GB pageable). Megatron's writer then killed it in its checkpoint save, staging the GPU's weights,
    # fp32 masters and half of Adam on the host too. Saved as each rank's shards by the streaming writer, two
    # tensors are in flight at most (2 x the fp32 embedding, 4.1 GiB): 100 GiB, and it saved; gathered into
    # the reshardable form, 36 B per parameter (255 GiB) instead: 351 GiB.
    resident = [a for a in args if "megatron.optimizer_offload" not in a and "fraction" not in a]
    resident += [
        "actor_rollout_ref.rollout.name=static",
        "actor_rollout_ref.rollout.max_num_seqs=512",
        f"+{OPTIM}override_optimizer_config.optimizer_cpu_offload=true",
        f"+{OPTIM}override_optimizer_config.optimizer_offload_fraction=0.5",
    ]
    assert main(["train", "--config", one_gpu, *resident, "trainer.host_memory_gib=256", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "a checkpoint save would need an estimated 351 GiB of host memory per node" in err, err
    assert "gathers the optimizer state into a layout-independent form (36 bytes per parameter" in err
    assert "dist_ckpt_optim_fully_reshardable=false saves each rank's shards instead" in err
    assert main(["train", "--config", one_gpu, *resident, per_rank, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"host memory per node\s*│\s*96\.1", out) and re.search(r"saving\s*│\s*100\.1", out), out
    assert "two tensors in flight" in out
    assert "50% of Adam" in out and "between updates" not in out  # stepped on the CPU; stays on the GPU
    # megatron's pin_cpu_grads=false: the gradients pageable, unrounded: 0.5 x 7.62e9 x (4 B x 1.886 + 12 B) = 69.3,
    # + the reference 14.2
    pageable = f"+{OPTIM}override_optimizer_config.pin_cpu_grads=false"
    assert main(["train", "--config", one_gpu, *resident, per_rank, pageable, "--dry-run"]) == 0
    assert re.search(r"host memory per node\s*│\s*83\.5", capsys.readouterr().out)
    # LoRA: the optimizer holds the 142.2M adapter parameters only, gathered at 36 B each (4.8 GiB), and there is
    # no reference copy. bench/lora_vs_trl.sh's 7B line on the H100 node (126 GiB) was refused here at 255 GiB.
    lora = [*args[:3], *LORA_64, "trainer.host_memory_gib=126"]
    assert main(["train", "--config", one_gpu, *lora, "--dry-run"]) == 0
    lora_offload = [*lora, *resident[-2:]]  # half of the adapters' Adam on the CPU: the table shows it
    assert main(["train", "--config", one_gpu, *lora_offload, "--dry-run"]) == 0
    assert re.search(r"host memory per node, saving\s*│\s*6\.\d", capsys.readouterr().out)


def test_log_prob_token_budgets_size_the_log_prob_phase():
    """Base: 512 + 1024 = 1536-token sequences, log-prob micro-batches of 8; a budget holds budget // 1536 rows,
    and the larger of the old and reference passes sizes the phase."""
    from grpo_core.config import load_config
    from grpo_core.models.shape import load_model_shape
    from grpo_core.planning.batches import log_prob_micro_batch
    from grpo_core.planning.budget import estimate_memory

    def cfg(*overrides):
        return load_config(BASE, list(overrides))

    old, ref = "actor_rollout_ref.rollout.log_prob_", "actor_rollout_ref.ref.log_prob_"
    assert log_prob_micro_batch(cfg()) == 8
    assert log_prob_micro_batch(cfg(f"{old}use_dynamic_bsz=true", f"{old}max_token_len_per_gpu=6144")) == 8  # ref's 8
    both = [f"{old}use_dynamic_bsz=true", f"{ref}use_dynamic_bsz=true", f"{ref}max_token_len_per_gpu=3072"]
    assert log_prob_micro_batch(cfg(*both, f"{old}max_token_len_per_gpu=6144")) == 4  # 6144 // 1536 > 3072 // 1536
    assert log_prob_micro_batch(cfg(*both, f"{old}max_token_len_per_gpu=30000")) == 19
    assert log_prob_micro_batch(cfg(*both, "actor_rollout_ref.actor.use_kl_loss=false")) == 10  # no ref pass: 16384
    shape = load_model_shape(cfg().actor_rollout_ref.model.path)
    small = estimate_memory(cfg(*both, f"{old}max_token_len_per_gpu=6144"), shape).phases["log_prob"]
    large = estimate_memory(cfg(*both, f"{old}max_token_len_per_gpu=30000"), shape).phases["log_prob"]
    assert large > small


def test_tp_above_the_kv_heads(capsys):
    # Qwen3-235B-A22B (64 heads, 4 KV heads) at TP=8: each KV head serves two ranks, as megatron allows.
    qwen3_235b_tp8 = [
        "actor_rollout_ref.model.path=Qwen/Qwen3-235B-A22B",
        f"{MEGA}tensor_model_parallel_size=8",
        f"{MEGA}pipeline_model_parallel_size=8",
        f"{MEGA}expert_model_parallel_size=8",
        f"+{MEGA}override_transformer_config.num_layers_in_first_pipeline_stage=11",
        f"+{MEGA}override_transformer_config.num_layers_in_last_pipeline_stage=11",
        *(f"{MEGA}{what}_offload=True" for what in ("param", "grad", "optimizer")),
        "actor_rollout_ref.rollout.tensor_model_parallel_size=8",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.85",
        "trainer.nnodes=8",
        "launch.launcher=slurm",
    ]
    assert main(["train", "--config", BASE, *qwen3_235b_tp8, "--dry-run"]) == 0, capsys.readouterr().err
    assert "world=64 TP=8 PP=8 CP=1 DP=1 EP=8" in capsys.readouterr().out
    # The base model's 28 heads divide by TP=14, its 4 KV heads neither divide by 14 nor does 14 by 4.
    tp14 = [
        f"{MEGA}tensor_model_parallel_size=14",
        f"{MEGA}pipeline_model_parallel_size=1",
        "trainer.n_gpus_per_node=14",
    ]
    assert main(["train", "--config", BASE, *tp14, "--dry-run"]) == 2
    assert "TP=14 neither divides the 4 KV heads nor is a multiple of them: TP must be a divisor of 4" in (
        capsys.readouterr().err
    )


# ---- actor_rollout_ref.model.override_config (verl: override_config.model_config.<HF field>) -----------------

OVERRIDE = "actor_rollout_ref.model.override_config"
DEEPSEEK = [
    "actor_rollout_ref.model.path=deepseek-ai/deepseek-llm-7b-chat",
    "data.max_response_length=4000",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
]


def test_override_config_raises_max_position_embeddings(capsys):
    # 512 + 4000 tokens exceed deepseek-llm-7b's 4096 positions ...
    assert main(["train", "--config", BASE, *DEEPSEEK, "--dry-run"]) == 2
    assert "exceeds the model's max_position_embeddings 4096" in capsys.readouterr().err
    # ... and fit in 10240, as in verl's Qwen3-30B script.
    over = f"+{OVERRIDE}.model_config.max_position_embeddings=10240"
    assert main(["train", "--config", BASE, *DEEPSEEK, over, "--dry-run"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "dry run OK" in out and "exceeds" not in out


def test_override_config_sections_other_than_model_config_are_refused(capsys):
    assert main(["train", "--config", BASE, f"+{OVERRIDE}.max_position_embeddings=10240", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"error: {OVERRIDE}: max_position_embeddings not supported; only {OVERRIDE}.model_config" in err
    assert "Traceback" not in err
    # verl's moe_config: its one switch, on, is a feature not offered; off (verl's default), a note
    assert main(["train", "--config", BASE, f"+{OVERRIDE}.moe_config.freeze_moe_router=true", "--dry-run"]) == 2
    assert "not offered here: MoE router freezing" in capsys.readouterr().err
    assert main(["train", "--config", BASE, f"+{OVERRIDE}.moe_config.freeze_moe_router=false", "--dry-run"]) == 0
    assert f"note: {OVERRIDE}.moe_config.freeze_moe_router=False: no effect here" in capsys.readouterr().out


def test_override_config_unknown_field_warns(capsys):
    typo = f"+{OVERRIDE}.model_config.max_position_embedings=10240"
    assert main(["train", "--config", BASE, typo, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"warning: {OVERRIDE}.model_config.max_position_embedings: the model's config.json has no such" in out


def test_memory_is_checked_against_this_machines_gpu_where_it_is_smaller(monkeypatch):
    """bench/grpo_step.sh's kept-engine run (configs/smollm2_gsm8k_gpu.yaml: gpu_memory_gib 140) ran out of memory in
    its update on an 80 GB H100, where the planner had estimated 86.9 GiB: the check now uses the card it is on
    (NVML's size, monkeypatched here)."""
    from grpo_core.checks.validate import check_config
    from grpo_core.config import load_config
    from grpo_core.models.shape import load_model_shape

    kept = [
        "actor_rollout_ref.model.path=Qwen/Qwen2.5-1.5B",
        "data.train_batch_size=64",
        "actor_rollout_ref.actor.ppo_mini_batch_size=32",
        "actor_rollout_ref.rollout.name=static",
        "actor_rollout_ref.rollout.max_num_seqs=512",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=32768",
        "actor_rollout_ref.rollout.free_cache_engine=false",
    ]
    cfg = load_config(REPO / "configs/smollm2_gsm8k_gpu.yaml", kept)
    shape = load_model_shape("Qwen/Qwen2.5-1.5B")
    # none, a larger card, one within 5% (a nominal size stands), an 80 GB H100
    for local, errors, warned in ((None, 0, False), (141.0, 0, False), (136.0, 0, False), (79.6, 1, True)):
        monkeypatch.setattr("grpo_core.config.hardware.local_gpu_memory_gib", lambda local=local: local)
        report = check_config(cfg, shape)
        memory = [e for e in report.errors if "estimated peak" in e]
        assert len(memory) == errors, report.errors
        mismatch = "trainer.gpu_memory_gib=140, but this machine's GPUs have 79.6 GiB"
        assert any(mismatch in w for w in report.warnings) == warned
    assert "exceeds this machine's GPU memory, 79.6 GiB" in memory[0]
    assert 79.6 * 0.9 < report.memory.peak < 140
    # the remedy names the largest update budget estimated to fit, in whole 512-token sequences (on that H100 the
    # kept-engine run trained at 8,192 tokens with a 59.1 GiB peak and at 12,288 with 69.3); the log-prob passes' stand
    fit = "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=10752"
    assert f"set {fit} (estimated to fit)" in memory[0]
    refitted = check_config(load_config(REPO / "configs/smollm2_gsm8k_gpu.yaml", [*kept, fit]), shape)
    assert not [e for e in refitted.errors if "estimated peak" in e] and refitted.memory.peak < 0.9 * 79.6


def test_fitting_batches_lowers_the_phase_over_the_gpu_and_stops_at_one_sequence(monkeypatch):
    """Lowering goes to the phase that is over each time (the update first, then the log-prob passes, the
    reference's with them), stops at the largest settings under the planner's 90%, and gives up where one sequence
    per micro-batch is not enough."""
    from grpo_core.checks.validate import check_config
    from grpo_core.config import load_config
    from grpo_core.models.shape import load_model_shape
    from grpo_core.planning.budget import estimate_memory, fitting_batches

    monkeypatch.setattr("grpo_core.config.hardware.local_gpu_memory_gib", lambda: None)
    shape = load_model_shape("Qwen/Qwen2.5-1.5B")
    budgets = [
        "actor_rollout_ref.model.path=Qwen/Qwen2.5-1.5B",
        "trainer.gpu_memory_gib=80",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=65536",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=131072",
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true",
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=65536",
    ]
    cfg = load_config(REPO / "configs/smollm2_gsm8k_gpu.yaml", budgets)
    fits = fitting_batches(cfg, shape)
    prefix = "actor_rollout_ref."
    assert set(fits) == {f"{prefix}actor.ppo_max_token_len_per_gpu", f"{prefix}rollout.log_prob_max_token_len_per_gpu",
                         f"{prefix}ref.log_prob_max_token_len_per_gpu"}  # fmt: skip
    sequence = cfg.data.max_prompt_length + cfg.data.max_response_length
    assert all(value % sequence == 0 for value in fits.values())  # budgets in whole sequences
    # the two log-prob passes meet at the same budget: the larger pass is lowered to the smaller's first
    assert (
        fits[f"{prefix}rollout.log_prob_max_token_len_per_gpu"] == fits[f"{prefix}ref.log_prob_max_token_len_per_gpu"]
    )
    fitted = load_config(REPO / "configs/smollm2_gsm8k_gpu.yaml", [*budgets, *(f"{k}={v}" for k, v in fits.items())])
    assert estimate_memory(fitted, shape).peak <= 0.9 * 80
    for key in fits:  # each is the largest that fits: one sequence more would not
        over = load_config(
            REPO / "configs/smollm2_gsm8k_gpu.yaml",
            [*budgets, *(f"{k}={v + sequence if k == key else v}" for k, v in fits.items())],
        )
        assert estimate_memory(over, shape).peak > 0.9 * 80, key
    # a 7B model's training state alone is over an 80 GiB GPU: no micro-batch fits, the error names what to lower
    big = [
        *budgets[1:],
        "actor_rollout_ref.model.path=Qwen/Qwen2.5-7B",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
    ]
    cfg = load_config(REPO / "configs/smollm2_gsm8k_gpu.yaml", big)
    assert fitting_batches(cfg, load_model_shape("Qwen/Qwen2.5-7B")) == {}
    error = next(e for e in check_config(cfg, load_model_shape("Qwen/Qwen2.5-7B")).errors if "estimated peak" in e)
    assert "lower actor_rollout_ref.actor.ppo_max_token_len_per_gpu (now 65536)" in error
    # generation over the GPU: its share is the engine's, no micro-batch setting is named
    greedy = [*budgets[:2], "actor_rollout_ref.rollout.gpu_memory_utilization=0.95"]
    report = check_config(load_config(REPO / "configs/smollm2_gsm8k_gpu.yaml", greedy), shape)
    error = next(e for e in report.errors if "estimated peak" in e)
    assert report.memory.peak_phase == "generation" and "in the guide's order: turn on param_offload" in error
