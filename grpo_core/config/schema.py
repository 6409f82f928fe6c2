"""The typed configuration tree.

Key names follow verl's (``data``, ``actor_rollout_ref.{model,actor,ref,rollout}``, ``algorithm``,
``trainer``), so command lines from verl's GRPO + Megatron guide work unchanged. Every leaf has a default
and a one-line help text (``grpo keys`` prints them). YAML files under ``configs/`` only set values;
a new setting is a field here, a variant is a YAML file; its default is written here only (code fed from
the config takes it through ``defaults.py``). Cross-field rules live in ``grpo_core/checks/``.
"""

from copy import deepcopy
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any


def setting(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A config field with its help text (and, for enums, the valid values) kept next to the default."""
    meta = {"help": help, "choices": choices}
    if is_dataclass(default) or isinstance(default, list | dict):
        return field(default_factory=lambda: deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


def section(cls: type, help: str) -> Any:
    return field(default_factory=cls, metadata={"help": help, "choices": None})


DTYPES = ("bfloat16", "float16", "float32")
LORA_LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # verl's megatron LoRA target names
# auto: bfloat16 where the hardware multiplies in it natively (GPUs; CPUs with AVX-512 or AMX), float32 elsewhere
AUTO_DTYPE = "auto"
DTYPE_SECTIONS = ("actor_rollout_ref.actor.megatron", "actor_rollout_ref.rollout", "evaluation")  # each has a dtype


@dataclass
class DataConfig:
    source: str = setting("openai/gsm8k", "what the pipeline prepares: GSM8K hub id, local directory or 'embedded'")
    train_files: list[str] = setting(["data/gsm8k/train.parquet"], "prepared training parquet file(s)")
    val_files: list[str] = setting(["data/gsm8k/test.parquet"], "prepared validation parquet file(s)")
    prompt_key: str = setting("prompt", "column holding the chat messages of the prompt")
    max_prompt_length: int = setting(512, "prompt tokens kept; longer prompts follow `truncation`")
    max_response_length: int = setting(1024, "most tokens generated per response")
    train_batch_size: int = setting(1024, "prompts sampled per training step (each gets `rollout.n` responses)")
    val_batch_size: int | None = setting(None, "prompts per validation batch (null: the whole set at once)")
    shuffle: bool = setting(True, "shuffle the training prompts every epoch")
    seed: int | None = setting(1, "seed of the prompt sampler (null: 1)")
    filter_overlong_prompts: bool = setting(True, "drop prompts longer than max_prompt_length up front")
    truncation: str = setting(
        "error", "what to do with a prompt over max_prompt_length", ("error", "left", "right", "middle")
    )


@dataclass
class LoRAConfig:
    rank: int = setting(0, "LoRA rank: > 0 trains low-rank adapters on the frozen base (0: all parameters)")
    alpha: float = setting(32.0, "LoRA scaling: the adapters' term is multiplied by alpha / rank")
    dropout: float = setting(0.0, "dropout on the adapters' input")
    target_modules: list[str] = setting(
        list(LORA_LINEARS),
        "linears that get adapters: linear_qkv, linear_proj, linear_fc1, linear_fc2, all-linear, or wildcard "
        "patterns on module names (decoder.layers.0.*)",
    )
    exclude_modules: list[str] = setting([], "linears that get no adapter (names or wildcard patterns)")
    lora_A_init_method: str = setting("xavier", "initialisation of A", ("xavier", "kaiming", "zero"))
    lora_B_init_method: str = setting(
        "zero", "initialisation of B (zero: training starts at the base)", ("zero", "xavier", "kaiming")
    )
    adapter_path: str | None = setting(
        None, "a PEFT adapter directory (grpo export --peft) the adapters start from instead of their init"
    )

    @property
    def start(self) -> str | None:
        """The adapter directory a LoRA run starts from (None: the adapters' init, or no LoRA)."""
        return self.adapter_path if self.rank > 0 else None


@dataclass
class ModelConfig:
    path: str = setting("Qwen/Qwen2-7B-Instruct", "Hugging Face model id or local directory")
    tokenizer_path: str | None = setting(None, "tokenizer id or directory (null: same as path)")
    trust_remote_code: bool = setting(False, "run model code shipped with the checkpoint (off: safer)")
    enable_gradient_checkpointing: bool = setting(False, "recompute activations in backward to save memory")
    use_remove_padding: bool = setting(True, "pack sequences without padding where the attention allows")
    override_config: dict[str, Any] = setting(
        {}, "Hugging Face config fields to override, verl's nesting: +...override_config.model_config.<field>=value"
    )
    lora: LoRAConfig = section(LoRAConfig, "LoRA adapters (verl's megatron lora.* keys)")


@dataclass
class OptimConfig:
    optimizer: str = setting("adam", "optimizer (megatron's Adam, AdamW-style weight decay)", ("adam",))
    lr: float = setting(1e-6, "peak learning rate")
    lr_warmup_steps: int = setting(-1, "warm-up steps (-1: use lr_warmup_steps_ratio)")
    lr_warmup_steps_ratio: float = setting(0.0, "warm-up as a fraction of the total steps")
    lr_decay_style: str = setting("constant", "schedule after warm-up", ("constant", "linear", "cosine"))
    min_lr: float = setting(0.0, "floor of the decayed learning rate")
    weight_decay: float = setting(0.01, "decoupled weight decay")
    adam_beta1: float = setting(0.9, "Adam beta1")
    adam_beta2: float = setting(0.999, "Adam beta2")
    total_training_steps: int | None = setting(None, "steps the schedule spans (null: from trainer)")
    initial_loss_scale: float = setting(65536.0, "fp16 only: first dynamic loss scale, halved on each overflow")
    override_optimizer_config: dict[str, Any] = setting(
        {}, "free-form megatron OptimizerConfig fields, added with +key=value (they win over optimizer_offload)"
    )


@dataclass
class MegatronConfig:
    tensor_model_parallel_size: int = setting(1, "TP: each layer's matrices split over this many GPUs")
    pipeline_model_parallel_size: int = setting(1, "PP: the layers split into this many stages")
    virtual_pipeline_model_parallel_size: int | None = setting(None, "interleaved stages per PP rank")
    context_parallel_size: int = setting(1, "CP: each sequence split over this many GPUs")
    expert_model_parallel_size: int = setting(1, "EP: MoE experts spread over this many GPUs")
    expert_tensor_parallel_size: int | None = setting(None, "ETP: TP inside each expert (null: 1 with EP>1)")
    sequence_parallel: bool = setting(True, "shard norms/dropout activations along the sequence when TP>1")
    use_distributed_optimizer: bool = setting(True, "shard optimizer states over data-parallel ranks")
    param_offload: bool = setting(False, "keep parameters in host memory outside their phase")
    grad_offload: bool = setting(False, "keep gradient buffers in host memory outside the update")
    optimizer_offload: bool = setting(False, "keep optimizer states in host memory outside the update")
    dist_ckpt_optim_fully_reshardable: bool = setting(
        True,
        "checkpoints' optimizer state resumable at any TP/PP (megatron gathers it: ~36 bytes of host memory per "
        "parameter per GPU while saving); false: each rank's own shards, resumable at the same TP/PP (Megatron-LM's "
        "default)",
    )
    dtype: str = setting(
        "bfloat16",
        "compute dtype (float16 trains with dynamic loss scaling; auto: bfloat16 where the hardware computes in it "
        "natively, else float32)",
        (*DTYPES, AUTO_DTYPE),
    )
    seed: int = setting(42, "seed of weight init and dropout")
    override_transformer_config: dict[str, Any] = setting(
        {}, "free-form megatron TransformerConfig fields, added with +key=value"
    )


@dataclass
class RefMegatronConfig:
    """The reference model's layout: every null inherits the actor's value."""

    tensor_model_parallel_size: int | None = setting(None, "TP of the reference model (null: actor's)")
    pipeline_model_parallel_size: int | None = setting(None, "PP of the reference model (null: actor's)")
    virtual_pipeline_model_parallel_size: int | None = setting(None, "VPP of the reference (null: actor's)")
    context_parallel_size: int | None = setting(None, "CP of the reference model (null: actor's)")
    expert_model_parallel_size: int | None = setting(None, "EP of the reference model (null: actor's)")
    expert_tensor_parallel_size: int | None = setting(None, "ETP of the reference model (null: actor's)")
    sequence_parallel: bool | None = setting(None, "sequence parallel for the reference (null: actor's)")
    param_offload: bool = setting(False, "keep the frozen reference weights in host memory between uses")
    override_transformer_config: dict[str, Any] = setting({}, "TransformerConfig overrides for the reference")


@dataclass
class PolicyLossConfig:
    loss_mode: str = setting(
        "vanilla",
        "policy-gradient loss, verl's names: vanilla (PPO's clipped token ratio with dual clip), gspo (one clipped "
        "ratio per sequence), sapo (soft gates), cispo (clipped, detached IS weight), geo_mean (GMPO), gpg, "
        "clip_cov, kl_cov, dppo_tv, dppo_kl, dro, bypass_mode (set by rollout_correction.bypass_mode)",
    )
    clip_cov_ratio: float = setting(0.0002, "clip_cov: share of valid tokens whose gradient is cut")
    clip_cov_lb: float = setting(1.0, "clip_cov: lower bound of the covariance of a token that may be cut")
    clip_cov_ub: float = setting(5.0, "clip_cov: upper bound of the covariance of a token that may be cut")
    kl_cov_ratio: float = setting(0.0002, "kl_cov: share of valid tokens (the largest covariances) KL-penalised")
    ppo_kl_coef: float = setting(0.1, "kl_cov: coefficient of the |log ratio| penalty")
    dro_beta: float | None = setting(None, "dro: coefficient of the quadratic log-ratio penalty (required, > 0)")


CHECKPOINT_CONTENTS = ("model", "optimizer", "extra", "hf_model")


@dataclass
class CheckpointConfig:
    save_contents: list[str] = setting(
        ["model", "optimizer", "extra"],
        "what each checkpoint holds: model, optimizer (Adam's state: 12 bytes a parameter), extra (lr schedule, "
        "RNG states), hf_model (the model as Hugging Face files in <checkpoint>/hf, what evaluation reads; "
        "`grpo export` writes them from any checkpoint)",
    )
    load_contents: list[str] | None = setting(
        None, "what a resume restores of what was saved (null: save_contents); without optimizer, Adam starts afresh"
    )


@dataclass
class ActorConfig:
    strategy: str = setting("megatron", "training backend", ("megatron",))
    ppo_mini_batch_size: int = setting(256, "prompts per optimizer step (times rollout.n responses)")
    ppo_micro_batch_size_per_gpu: int | None = setting(
        4, "responses per forward/backward on one GPU (null: only with use_dynamic_bsz)"
    )
    ppo_epochs: int = setting(1, "passes over each step's rollouts")
    shuffle: bool = setting(False, "shuffle rollouts between mini-batches")
    use_dynamic_bsz: bool = setting(False, "size micro-batches by token count instead of responses")
    ppo_max_token_len_per_gpu: int = setting(16384, "token budget per micro-batch when use_dynamic_bsz")
    clip_ratio: float = setting(0.2, "PPO clip range epsilon")
    clip_ratio_low: float | None = setting(None, "lower clip epsilon (null: clip_ratio)")
    clip_ratio_high: float | None = setting(None, "upper clip epsilon, 'clip-higher' (null: clip_ratio)")
    clip_ratio_c: float = setting(3.0, "dual-clip bound for negative advantages (> 1); dppo_*: ratio truncation")
    tau_pos: float = setting(1.0, "sapo: gate temperature for tokens with a positive advantage")
    tau_neg: float = setting(1.05, "sapo: gate temperature for the others (> tau_pos: faster fade)")
    loss_agg_mode: str = setting("token-mean", "how token losses become one number")
    loss_scale_factor: float | None = setting(
        None, "seq-mean-token-sum-norm (Dr.GRPO): divides each response's token sum (null: max_response_length)"
    )
    entropy_coeff: float = setting(0.0, "entropy bonus subtracted from the loss")
    use_kl_loss: bool = setting(True, "add a KL(actor || reference) term to the loss (GRPO's way)")
    kl_loss_coef: float = setting(0.001, "weight of the KL loss (guide spelling: kl_coeff)")
    kl_loss_type: str = setting("low_var_kl", "KL estimator of the KL loss")
    grad_clip: float = setting(
        1.0, "max global gradient norm (guide spelling: gradient_clipping; verl: optim.clip_grad)"
    )
    policy_loss: PolicyLossConfig = section(PolicyLossConfig, "the policy-gradient loss")
    optim: OptimConfig = section(OptimConfig, "optimizer and learning-rate schedule")
    megatron: MegatronConfig = section(MegatronConfig, "megatron-core parallel layout and memory options")
    checkpoint: CheckpointConfig = section(CheckpointConfig, "what checkpoints hold and what a resume restores")


@dataclass
class RefConfig:
    log_prob_micro_batch_size_per_gpu: int | None = setting(None, "responses per ref forward (null: actor's)")
    log_prob_use_dynamic_bsz: bool | None = setting(
        None, "size ref-forward micro-batches by token count instead (null: actor.use_dynamic_bsz, as verl)"
    )
    log_prob_max_token_len_per_gpu: int | None = setting(
        None, "token budget per ref forward when log_prob_use_dynamic_bsz (null: actor.ppo_max_token_len_per_gpu)"
    )
    megatron: RefMegatronConfig = section(RefMegatronConfig, "reference model layout (inherits the actor's)")


@dataclass
class ValKwargs:
    n: int = setting(1, "samples per validation prompt")
    temperature: float = setting(0.0, "validation sampling temperature (0: greedy)")
    top_p: float = setting(1.0, "validation nucleus sampling")
    top_k: int = setting(-1, "validation top-k sampling (-1: off)")
    do_sample: bool = setting(False, "sample during validation (false: greedy)")


@dataclass
class RolloutConfig:
    name: str = setting(
        "vllm",
        "generation engine (static: ours, a static KV cache replayed as CUDA graphs)",
        ("vllm", "hf", "megatron", "static"),
    )
    mode: str = setting(
        "sync",
        "verl's rollout server mode: both run the engine colocated with the actor, between training phases",
        ("sync", "async"),
    )
    n: int = setting(5, "responses per prompt: the GRPO group size (guide spelling: algorithm.group_size)")
    temperature: float = setting(1.0, "sampling temperature")
    top_p: float = setting(1.0, "nucleus sampling")
    top_k: int = setting(-1, "top-k sampling (-1: off)")
    dtype: str = setting("bfloat16", "engine weight dtype (auto: as the actor's auto)", (*DTYPES, AUTO_DTYPE))
    tensor_model_parallel_size: int = setting(1, "TP of the rollout engine (may differ from the actor's)")
    gpu_memory_utilization: float = setting(0.5, "share of GPU memory the engine may take (weights + KV)")
    max_num_batched_tokens: int = setting(8192, "engine's token budget per scheduler step")
    max_num_seqs: int = setting(
        256, "engine's most concurrent sequences (megatron, static: rows per forward, sizing the preallocated KV cache)"
    )
    enforce_eager: bool = setting(False, "disable CUDA graphs in the engine")
    free_cache_engine: bool = setting(True, "release the KV cache during the update (sleep/wake)")
    log_prob_micro_batch_size_per_gpu: int | None = setting(None, "responses per old-log-prob forward")
    log_prob_use_dynamic_bsz: bool | None = setting(
        None, "size old-log-prob micro-batches by token count instead (null: actor.use_dynamic_bsz, as verl)"
    )
    log_prob_max_token_len_per_gpu: int | None = setting(
        None,
        "token budget per old-log-prob forward when log_prob_use_dynamic_bsz (null: actor.ppo_max_token_len_per_gpu)",
    )
    seed: int = setting(0, "engine-level sampling seed")
    val_kwargs: ValKwargs = section(ValKwargs, "sampling settings for validation")


@dataclass
class ActorRolloutRefConfig:
    hybrid_engine: bool = setting(True, "actor, reference and rollout share the same GPUs")
    nccl_timeout: int = setting(
        1800, "seconds a collective may wait before the job fails (NCCL/gloo timeout; verl's default is 600)"
    )
    model: ModelConfig = section(ModelConfig, "the policy model")
    actor: ActorConfig = section(ActorConfig, "the trained policy")
    ref: RefConfig = section(RefConfig, "the frozen reference policy for the KL term")
    rollout: RolloutConfig = section(RolloutConfig, "response generation")


@dataclass
class KLControlConfig:
    type: str = setting("fixed", "KL-in-reward controller", ("fixed",))
    kl_coef: float = setting(0.001, "KL-in-reward coefficient")


@dataclass
class RolloutCorrectionConfig:
    rollout_is: str | None = setting(
        None,
        "truncated importance sampling against the rollout engine's log-probs: token, sequence or null (off); "
        "each token's policy loss is weighted by min(pi_old / pi_rollout, rollout_is_threshold)",
    )
    rollout_is_threshold: Any = setting(
        2.0,
        "a number: the upper bound the weights are truncated at (TIS); 'lower_upper' (e.g. '0.5_5.0'; unquoted 0.5_2 "
        "too, not YAML's 0.52): weights outside [lower, upper] are 0 (IcePop)",
    )
    rollout_is_batch_normalize: bool = setting(
        False, "divide the step's importance weights by their mean (per token, or per sequence), so they average 1"
    )
    rollout_rs: str | None = setting(
        None,
        "rejection sampling: comma-separated token_k1..3, seq_sum_k1..3, seq_mean_k1..3, seq_max_k2/k3 (k1 = -log "
        "ratio, k2 = log ratio^2 / 2, k3 = ratio - 1 - log ratio, of pi_old / pi_rollout); rejected tokens (a seq_* "
        "option: the whole response) leave the loss",
    )
    rollout_rs_threshold: Any = setting(
        None,
        "rollout_rs's bounds, one for all options or one per option: k1 'lower_upper' (or one upper ratio), "
        "k2/k3 an upper bound",
    )
    bypass_mode: bool = setting(
        False, "use the engine's log-probs as the old policy's (two policies, not three): policy loss bypass_mode"
    )
    loss_type: str = setting(
        "ppo_clip", "bypass_mode's loss: ppo_clip (PPO's clip of pi / pi_rollout) or reinforce (-w A log pi)"
    )


@dataclass
class FilterGroupsConfig:
    enable: bool = setting(
        False, "DAPO's dynamic sampling: drop prompt groups whose responses all score alike, draw more batches"
    )
    metric: str = setting(
        "acc",
        "what must differ within a group: acc (full score or not; built-in rewards), score / seq_reward (the rule "
        "reward), seq_final_reward (after the overlong shaping)",
    )
    max_num_gen_batches: int = setting(
        0, "most prompt batches drawn per step (0: no limit); short of groups then, the step trains on those kept"
    )


@dataclass
class AlgorithmConfig:
    adv_estimator: str = setting(
        "grpo",
        "advantage estimator, verl's names: grpo, grpo_vectorized, rloo, rloo_vectorized, reinforce_plus_plus, "
        "reinforce_plus_plus_baseline, gdpo (one reward component), grpo_passk, opo, gpg, remax (baseline: a greedy "
        "response per prompt, drawn with the rollouts and scored, not trained on)",
    )
    norm_adv_by_std_in_grpo: bool = setting(True, "divide by the group's std (false: Dr.GRPO)")
    gamma: float = setting(1.0, "discount of the token-level rewards' returns (reinforce_plus_plus)")
    lam: float = setting(1.0, "GAE lambda: no estimator offered here uses it")
    use_kl_in_reward: bool = setting(False, "subtract a KL penalty from the reward (GRPO uses the KL loss)")
    kl_penalty: str = setting("kl", "KL estimator of the in-reward penalty")
    kl_ctrl: KLControlConfig = section(KLControlConfig, "in-reward KL coefficient control")
    filter_groups: FilterGroupsConfig = section(FilterGroupsConfig, "DAPO's dynamic sampling")
    rollout_correction: RolloutCorrectionConfig = section(
        RolloutCorrectionConfig, "correction of the training-inference mismatch (rollout importance sampling)"
    )


@dataclass
class OverlongBufferConfig:
    enable: bool = setting(False, "DAPO's soft overlong punishment of responses near max_resp_len")
    len: int = setting(0, "the last this many tokens before max_resp_len are penalised, linearly to -penalty_factor")
    penalty_factor: float = setting(1.0, "the penalty at max_resp_len")
    log: bool = setting(False, "verl's per-response record; the mean penalty and the share penalised are always logged")


@dataclass
class RewardKwargs:
    max_resp_len: int | None = setting(
        None,
        "the response length the overlong buffer counts back from (given as recipe/dapo's "
        "reward_model.overlong_buffer.*: data.max_response_length unless set)",
    )
    overlong_buffer_cfg: OverlongBufferConfig = section(OverlongBufferConfig, "DAPO's overlong reward shaping")


@dataclass
class RewardModelConfig:
    enable: bool = setting(False, "score with a learned reward model (not supported: rule rewards only)")
    reward_manager: str = setting(
        "naive", "how responses are scored: the rule reward, or it plus DAPO's overlong shaping", ("naive", "dapo")
    )
    reward_kwargs: RewardKwargs = section(RewardKwargs, "arguments of the reward manager (dapo)")
    method: str = setting("strict", "answer extraction: '#### N' only, or the last number", ("strict", "flexible"))
    format_score: float = setting(0.0, "reward for a well-formed but wrong answer")
    score: float = setting(1.0, "reward for a right answer")


@dataclass
class CustomRewardFunctionConfig:
    path: str | None = setting(None, "Python file with your reward function (null: the built-in one per data_source)")
    name: str = setting(
        "compute_score",
        "its function: (data_source, solution_str, ground_truth, extra_info=None) -> float or {'score': float, ...}",
    )


@dataclass
class TrainerConfig:
    project_name: str = setting("grpo", "MLflow experiment / project name")
    experiment_name: str = setting("gsm8k", "run name")
    logger: list[str] = setting(["console"], "metric sinks: console, mlflow, tensorboard, wandb")
    nnodes: int = setting(1, "number of nodes")
    n_gpus_per_node: int = setting(8, "GPUs (on CPU: processes) per node")
    device: str = setting("cuda", "accelerator", ("cuda", "cpu"))
    gpu_memory_gib: float = setting(80.0, "memory of one GPU, for the dry run's memory check")
    host_memory_gib: float | None = setting(
        None, "host memory of one node, for the offload check (null: this machine's, when it has a GPU)"
    )
    total_epochs: int = setting(1, "passes over the training prompts")
    total_training_steps: int | None = setting(None, "stop after this many steps (null: from epochs)")
    save_freq: int = setting(-1, "checkpoint every N steps (-1: only at the end)")
    test_freq: int = setting(-1, "validate every N steps (-1: never)")
    val_before_train: bool = setting(False, "validate the initial model first")
    default_local_dir: str | None = setting(
        "checkpoints", "where checkpoints and local logs go (null: verl's checkpoints/<project_name>/<experiment_name>)"
    )
    resume_mode: str = setting("auto", "auto (latest checkpoint), disable, resume_path, or a checkpoint path")
    resume_from_path: str | None = setting(None, "the checkpoint to resume from when resume_mode=resume_path")
    max_actor_ckpt_to_keep: int | None = setting(2, "newest checkpoints kept; older ones are deleted (null: all)")
    hang_timeout_s: float | None = setting(
        None,
        "a phase of a step (gen, old_log_prob, ref, update, sync) still running on a rank after this long is a hang: "
        "every rank's Python stacks go to the log and the job ends (null: 5 x the slowest step so far, at least "
        "600 s; 3600 s until a step has finished)",
    )
    profile_steps: list[int] = setting(
        [], "steps (as logged, from 1) run under torch.profiler: trace in <default_local_dir>/profile/, comm share"
    )
    env: dict[str, str] = setting(
        {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_P2P_LEVEL": "NVL", "NCCL_DEBUG": "WARN"},
        "environment exported to every training process",
    )


@dataclass
class LaunchConfig:
    launcher: str = setting("torchrun", "how the ranks are started", ("torchrun", "slurm"))
    node_rank: int = setting(0, "this node's rank when trainer.nnodes > 1 (torchrun)")
    rdzv_endpoint: str | None = setting(None, "HOST:PORT of the c10d rendezvous on node 0 (torchrun, nnodes > 1)")
    rdzv_id: str = setting("grpo", "rendezvous id shared by the nodes of one job (torchrun)")
    stuck_timeout_s: float | None = setting(1800.0, "fail the job when no rank logs anything for this long")
    timeout_s: float | None = setting(None, "stop the job after this long, as SIGTERM does (null: no limit)")
    stop_grace_s: float = setting(
        300.0,
        "after SIGTERM, SIGUSR1, Ctrl-C or timeout_s: how long the ranks get to finish their step and save it "
        "(Slurm: SIGUSR1 comes this long before slurm_time_limit_min)",
    )
    slurm_time_limit_min: int = setting(240, "Slurm job time limit, minutes")
    slurm_options: list[str] = setting([], "extra sbatch options, e.g. ['--partition=gpu', '--account=rl']")


@dataclass
class EvaluationConfig:
    data_file: str | None = setting(None, "parquet the pipeline evaluates on (null: data.val_files[0])")
    n: int = setting(1, "samples per question")
    temperature: float = setting(0.0, "0 is greedy (pass@1)")
    max_new_tokens: int = setting(512, "most tokens per answer")
    batch_size: int = setting(32, "sequences generated at once")
    limit: int | None = setting(None, "only the first N questions (null: all)")
    metric: str = setting(
        "accuracy_strict", "reported as val/accuracy and used for the uplift", ("accuracy_strict", "accuracy_flexible")
    )
    engine: str = setting(
        "hf",
        "hf: transformers' generate (any causal LM); static: the static-cache engine (dense Llama/Qwen2/Qwen3, "
        "several times faster)",
        ("hf", "static"),
    )
    dtype: str | None = setting(
        None,
        "weights and compute (null: float32 on a CPU, bfloat16 on a GPU; auto: as the actor's auto)",
        (None, "float32", "bfloat16", AUTO_DTYPE),
    )


@dataclass
class TrackingConfig:
    mlflow_tracking_uri: str | None = setting(
        None, "MLflow tracking URI, e.g. http://HOST:5000 (null: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)"
    )
    registered_model_name: str | None = setting(None, "MLflow registry name (null: trainer.project_name)")
    champion_min_uplift: float = setting(
        0.0, "the new version becomes `champion` only when its uplift over the champion (else the base) exceeds this"
    )
    champion_alpha: float = setting(
        0.05, "... and when the paired test's p-value (exact McNemar) is below this; otherwise it is `challenger`"
    )
    model_cache_dir: str | None = setting(
        None, "where models:/NAME@ALIAS model paths are downloaded, per version (null: ~/.cache/grpo/models)"
    )
    log_model: bool = setting(True, "log the trained model as an artifact and register it")
    train_retries: int = setting(
        1, "the pipeline's train task: retries after a crash or a hang, each resuming from the last checkpoint"
    )
    train_retry_delay_s: float = setting(30.0, "the pipeline's train task: seconds before a retry")
    notify_webhook_url: str | None = setting(
        None,
        "a webhook URL (Slack, Teams, any HTTP endpoint) the pipeline posts one notice to when a run fails or a "
        "scheduled run's challenger is worse than the champion with p < champion_alpha; a secret (shown as ***): "
        "write ${oc.env:NAME} to keep it off command lines",
    )
    notify_block: str | None = setting(
        None, "the same notice through a saved Prefect notification block, TYPE/NAME (e.g. slack-webhook/ml-alerts)"
    )


@dataclass
class GRPOConfig:
    data: DataConfig = section(DataConfig, "prompts")
    actor_rollout_ref: ActorRolloutRefConfig = section(ActorRolloutRefConfig, "models and their engines")
    algorithm: AlgorithmConfig = section(AlgorithmConfig, "advantage and KL settings")
    reward_model: RewardModelConfig = section(RewardModelConfig, "rule-based reward")
    custom_reward_function: CustomRewardFunctionConfig = section(
        CustomRewardFunctionConfig, "a reward function of your own, replacing the built-in rule reward"
    )
    trainer: TrainerConfig = section(TrainerConfig, "run length, logging, checkpoints, cluster shape")
    launch: LaunchConfig = section(LaunchConfig, "how the ranks are started: torchrun or Slurm")
    evaluation: EvaluationConfig = section(EvaluationConfig, "the pipeline's GSM8K evaluation before and after")
    tracking: TrackingConfig = section(TrackingConfig, "MLflow and its model registry")


FREE_FORM_KEYS = ("override_transformer_config", "override_optimizer_config", "override_config", "env")
"""Dict-typed settings whose keys the schema does not know; new keys are added with ``+key=value``."""


def iter_settings(cls: type = GRPOConfig, prefix: str = ""):
    """Yield ``(dotted_key, field)`` for every leaf setting of the tree."""
    for f in fields(cls):
        key = f"{prefix}{f.name}"
        if f.default_factory is not MISSING and is_dataclass(f.type):
            yield from iter_settings(f.type, key + ".")
        else:
            yield key, f
