"""verl's configuration keys that are not settings of this project, each with the reason ``grpo keys`` shows.

verl's Megatron trainer tree (``ppo_megatron_trainer.yaml`` and the sections it composes) falls into four
classes: (a) implemented with verl's meaning: the settings of ``schema.py``; (b) other spellings of them:
``load.ALIASES``; (c) accepted with no effect here, one ``note:`` line per key a user sets; (d) a feature not
offered, refused with exit 2 and one line naming the feature. (c) and (d) are ``IGNORED_AND_REFUSED`` below;
``REFUSED_VALUES`` holds the values of implemented keys that select such a feature (``rollout.name=sglang``).
Written from verl's documented key names; a ``*`` in a pattern matches the rest of a dotted key.
"""

from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

ARR = "actor_rollout_ref"


@dataclass(frozen=True)
class ForeignKey:
    pattern: str
    reason: str
    refused: bool = False
    off: tuple = ()  # for a refused key: values that leave its feature off, accepted with a note instead

    def refuses(self, value: Any) -> bool:
        return self.refused and not any(value == v and type(value) is type(v) for v in self.off)


def _ignored(reason: str, *patterns: str) -> list[ForeignKey]:
    return [ForeignKey(p, reason) for p in patterns]


def _refused(feature: str, *patterns: str, off: tuple = ()) -> list[ForeignKey]:
    return [ForeignKey(p, feature, refused=True, off=off) for p in patterns]


NO_CRITIC = "GRPO has no critic (value model); critic settings have no effect"
NO_RAY = "there is no Ray here: the ranks are started by torchrun or Slurm (launch.*)"
PROFILER = "verl's nsys/npu/torch profiler settings: use trainer.profile_steps (a torch.profiler trace per step) here"
FSDP = "FSDP settings, which verl too ignores under its Megatron strategy"
BRIDGE = "the project's own Hugging Face <-> megatron-core bridge always converts the model"
DIST_CKPT = (
    "the initial weights are always read from model.path through the bridge, and training checkpoints are "
    "megatron distributed checkpoints (torch DCP) regardless"
)
FUSED = "log-probs and entropy always come from the project's fused vocab-parallel kernels (actor/logprobs.py)"
REWARD_MODEL = "learned reward models are not offered (rule rewards only): these settings configure one"
SINGLE_TURN = "single-turn generation only: multi-turn/tool-use agent loops are not offered"
LORA_OTHER = "this LoRA setting (rank, alpha, dropout, target_modules, exclude_modules and the init methods are)"
REF_FROZEN = "the reference model is frozen: it has no gradients or optimizer"
REF_FOLLOWS = "the reference model is built like the actor (same dtype, seed and megatron settings)"
DEPRECATED_GLOBAL = "verl's deprecated global micro-batch size: set the *_per_gpu key instead"

IGNORED_AND_REFUSED: list[ForeignKey] = [
    ForeignKey("_target_", "Hydra's class path of a section: the tree is typed here"),
    ForeignKey("*._target_", "Hydra's class path of a section: the tree is typed here"),
    # ---- actor ---------------------------------------------------------------------------------------
    *_ignored(
        "the scheduler always runs warm-up from 0 then lr_decay_style over the run's optimizer steps",
        f"{ARR}.actor.optim.lr_warmup_init",
        f"{ARR}.actor.optim.lr_decay_steps",
    ),
    *_ignored("weight decay is constant here", f"{ARR}.actor.optim.weight_decay_incr_style"),
    *_ignored(
        "used only by lr_decay_style=WSD, which is not offered",
        f"{ARR}.actor.optim.lr_wsd_decay_style",
        f"{ARR}.actor.optim.lr_wsd_decay_steps",
    ),
    *_ignored(
        "the learning-rate scheduler's state is always saved in and restored from checkpoints",
        f"{ARR}.actor.optim.use_checkpoint_opt_param_scheduler",
    ),
    *_ignored(
        "the project's layer spec chooses the attention kernel (torch SDPA; varlen flash attention for packed rows)",
        f"{ARR}.*.megatron.override_transformer_config.attention_backend",
    ),
    *_ignored(
        DIST_CKPT,
        *(
            f"{ARR}.{w}.megatron.{k}"
            for w in ("actor", "ref")
            for k in ("use_dist_checkpointing", "dist_checkpointing_path", "dist_checkpointing_prefix")
        ),
    ),
    *_ignored(
        BRIDGE,
        *(
            f"{ARR}.{w}.megatron.{k}"
            for w in ("actor", "ref")
            for k in ("use_mbridge", "vanilla_mbridge", "override_mcore_model_config", "override_mcore_model_config.*")
        ),
    ),
    *_ignored(
        "megatron's DDP settings are chosen by the actor (fp32 gradient buckets, grad-reduce overlap when DP > 1)",
        *(f"{ARR}.{w}.megatron.override_ddp_config{s}" for w in ("actor", "ref") for s in ("", ".*")),
    ),
    *_ignored(
        "internal to verl's engine (a forward-only worker)",
        f"{ARR}.actor.megatron.forward_only",
        f"{ARR}.ref.megatron.forward_only",
    ),
    *_ignored("text models only: there is no vision tower", f"{ARR}.actor.freeze_vision_tower"),
    *_ignored(
        "verl's torch.compile of its FSDP entropy: the megatron actor's kernels are compiled on GPUs regardless "
        "(turn single fusions off with override_transformer_config)",
        f"{ARR}.actor.use_torch_compile",
        f"{ARR}.ref.use_torch_compile",
    ),
    *_ignored(
        FUSED, f"{ARR}.actor.use_fused_kernels", f"{ARR}.model.use_fused_kernels", f"{ARR}.model.fused_kernel_options.*"
    ),
    *_ignored(
        "checkpoints are written synchronously, each tensor streamed from the GPU to its file (host memory stays "
        "bounded); actor.checkpoint.save_contents and load_contents are settings",
        f"{ARR}.actor.checkpoint.*",
    ),
    *_ignored(
        PROFILER, f"{ARR}.actor.profiler.*", f"{ARR}.ref.profiler.*", f"{ARR}.rollout.profiler.*", "global_profiler.*"
    ),
    *_ignored("mini-batches are shuffled by actor.shuffle with data.seed", f"{ARR}.actor.data_loader_seed"),
    *_ignored("weights are always loaded from model.path", f"{ARR}.actor.load_weight", f"{ARR}.ref.load_weight"),
    *_ignored(
        "FSDP's scheduler keys: the megatron actor's are lr_warmup_steps(_ratio), lr_decay_style and min_lr",
        f"{ARR}.actor.optim.min_lr_ratio",
        f"{ARR}.actor.optim.num_cycles",
        f"{ARR}.actor.optim.warmup_style",
    ),
    *_ignored(
        "FSDP's entropy memory savers: the fused log-prob kernels never hold an fp32 [tokens, vocab] tensor",
        *(f"{ARR}.{w}.entropy_{k}" for w in ("actor", "ref") for k in ("from_logits_with_chunking", "checkpointing")),
    ),
    *_ignored(
        "the reference model is the actor's initial model (model.path)", f"{ARR}.ref.model", f"{ARR}.ref.model.*"
    ),
    *_ignored(
        "verl derives it from actor_rollout_ref.model.use_remove_padding, which sets packing here",
        f"{ARR}.actor.use_remove_padding",
        f"{ARR}.ref.use_remove_padding",
    ),
    *_ignored("FSDP's layered weight summoning for LoRA", f"{ARR}.rollout.layered_summon"),
    *_ignored(
        "verl's choice of worker implementation: there are no Ray workers here", "trainer.use_legacy_worker_impl"
    ),
    *_refused(
        "verl's other training engines (model_engine: the actor trains on megatron-core; model_engine=megatron is "
        "what runs here)",
        "model_engine",
        off=("megatron",),
    ),
    *_refused("validation-only runs (use `grpo evaluate` on the model)", "trainer.val_only", off=(False,)),
    *_ignored(
        FSDP,
        f"{ARR}.actor.fsdp_config.*",
        f"{ARR}.ref.fsdp_config.*",
        f"{ARR}.actor.ulysses_sequence_parallel_size",
        f"{ARR}.ref.ulysses_sequence_parallel_size",
    ),
    *_refused(
        DEPRECATED_GLOBAL,
        f"{ARR}.actor.ppo_micro_batch_size",
        f"{ARR}.ref.log_prob_micro_batch_size",
        f"{ARR}.rollout.log_prob_micro_batch_size",
        off=(None,),
    ),
    # ---- reference -------------------------------------------------------------------------------------
    *_ignored("the reference model runs on megatron, like the actor", f"{ARR}.ref.strategy"),
    *_ignored(
        REF_FROZEN,
        *(f"{ARR}.ref.megatron.{k}" for k in ("grad_offload", "optimizer_offload", "use_distributed_optimizer")),
    ),
    *_ignored(REF_FOLLOWS, f"{ARR}.ref.megatron.seed", f"{ARR}.ref.megatron.dtype"),
    # ---- rollout ---------------------------------------------------------------------------------------
    *_ignored(
        "set by data.max_prompt_length / data.max_response_length",
        f"{ARR}.rollout.prompt_length",
        f"{ARR}.rollout.response_length",
        f"{ARR}.rollout.max_model_len",
    ),
    *_refused("generating past the end-of-sequence token (ignore_eos)", f"{ARR}.rollout.ignore_eos", off=(False,)),
    *_ignored(
        "vLLM chooses its CUDA-graph sizes; the static engine captures one graph per batch shape",
        f"{ARR}.rollout.cudagraph_capture_sizes",
    ),
    *_ignored(
        "one engine replica per rollout-TP group of ranks: its data/expert parallel sizes follow from the world size",
        f"{ARR}.rollout.data_parallel_size",
        f"{ARR}.rollout.expert_parallel_size",
    ),
    *_refused("pipeline-parallel rollout engines", f"{ARR}.rollout.pipeline_model_parallel_size", off=(1,)),
    *_ignored(
        "vLLM's own defaults apply (chunked prefill and prefix caching on)",
        f"{ARR}.rollout.enable_chunked_prefill",
        f"{ARR}.rollout.enable_prefix_caching",
    ),
    *_ignored(
        "the engine starts from the actor's weights, pushed before the first rollout", f"{ARR}.rollout.load_format"
    ),
    *_ignored("vLLM's statistics logging stays off", f"{ARR}.rollout.disable_log_stats"),
    *_ignored("sampling follows temperature (0: greedy)", f"{ARR}.rollout.do_sample"),
    *_ignored("each prompt is sampled exactly rollout.n times", f"{ARR}.rollout.over_sample_rate"),
    *_ignored("the engine wakes in one stage (weights and KV cache together)", f"{ARR}.rollout.multi_stage_wake_up"),
    *_ignored(
        "engine-specific arguments of verl's vLLM/SGLang/TRT-LLM servers: not passed through",
        f"{ARR}.rollout.engine_kwargs.*",
    ),
    *_ignored(
        "the engines always return the sampled tokens' log-probs (logged as rollout/log_prob_diff_*)",
        f"{ARR}.rollout.calculate_log_probs",
    ),
    *_ignored(
        "weights are synced tensor by tensor, in place, with no transfer buckets",
        f"{ARR}.rollout.update_weights_bucket_megabytes",
        f"{ARR}.rollout.checkpoint_engine.*",
    ),
    *_refused(SINGLE_TURN, f"{ARR}.rollout.multi_turn.enable", off=(False,)),
    *_ignored("used only with rollout.multi_turn.enable=true, which is not offered", f"{ARR}.rollout.multi_turn.*"),
    *_ignored(SINGLE_TURN + " (agent loop settings)", f"{ARR}.rollout.agent.*"),
    *_ignored("rollout traces (weave/mlflow spans) are not recorded", f"{ARR}.rollout.trace.*"),
    *_refused("replaying dumped rollouts (skip_rollout)", f"{ARR}.rollout.skip_rollout", off=(False,)),
    *_ignored("used only with skip_rollout", f"{ARR}.rollout.skip_dump_dir"),
    *_ignored("the engines always load the tokenizer", f"{ARR}.rollout.skip_tokenizer_init"),
    *_ignored("use the run diagnostics (gpu/*, profile/*) and MLflow", f"{ARR}.rollout.prometheus.*"),
    *_refused("quantized (FP8) rollout", f"{ARR}.rollout.quantization", off=(False, None)),
    *_ignored("used only with quantized rollout, which is not offered", f"{ARR}.rollout.use_block_quant_rollout"),
    *_ignored("the bridge names the engine's fused weights", f"{ARR}.rollout.layer_name_map.*"),
    # ---- model -----------------------------------------------------------------------------------------
    *_refused(
        "custom chat templates (the tokenizer's own template is used)", f"{ARR}.model.custom_chat_template", off=(None,)
    ),
    *_refused("importing a user's model library (external_lib)", f"{ARR}.model.external_lib", off=(None,)),
    *_refused(
        "LoRA types other than plain lora (canonical_lora, vlm_lora, dora)", f"{ARR}.model.lora.type", off=("lora",)
    ),
    *_ignored(
        "the rollout engines always get the merged weights W + alpha/rank B A after each update",
        f"{ARR}.model.lora.merge",
        f"{ARR}.model.lora.fully_sharded_loras",
    ),
    *_refused(
        "dropout after the LoRA projection (dropout_position=post)", f"{ARR}.model.lora.dropout_position", off=("pre",)
    ),
    *_refused("LoRA adapters in a dtype of their own (they take the model's)", f"{ARR}.model.lora.dtype", off=(None,)),
    *_refused(
        "megatron-bridge's all-to-all LoRA (a2a_experimental)", f"{ARR}.model.lora.a2a_experimental", off=(False,)
    ),
    *_ignored(
        "text models only: there is no vision model to freeze",
        f"{ARR}.model.lora.freeze_vision_model",
        f"{ARR}.model.lora.freeze_vision_projection",
    ),
    *_refused(
        "training the language model in full beside LoRA", f"{ARR}.model.lora.freeze_language_model", off=(True,)
    ),
    *_refused(LORA_OTHER, f"{ARR}.model.lora.*"),
    *_ignored("Liger kernels are for FSDP models: " + FUSED, f"{ARR}.model.use_liger"),
    *_ignored("model files are read from disk (or the hub cache)", f"{ARR}.model.use_shm"),
    *_ignored(
        "activation offload is an FSDP feature; use recompute (override_transformer_config) here",
        f"{ARR}.model.enable_activation_offload",
    ),
    *_refused(
        "MoE router freezing (override_config.moe_config)",
        f"{ARR}.model.override_config.moe_config.freeze_moe_router",
        off=(False,),
    ),
    # ---- data ------------------------------------------------------------------------------------------
    *_ignored("prompts are tokenized with actor_rollout_ref.model's tokenizer", "data.tokenizer"),
    *_ignored(
        "data is read directly from the parquet files",
        "data.use_shm",
        "data.dataloader_num_workers",
        "data.filter_overlong_prompts_workers",
    ),
    *_ignored(
        "prompts are kept as chat messages and templated by the tokenizer; raw chats are always available",
        "data.return_raw_chat",
        "data.return_raw_input_ids",
        "data.return_full_prompt",
    ),
    *_ignored(
        "text prompts only",
        "data.image_key",
        "data.video_key",
        "data.image_patch_size",
        "data.return_multi_modal_inputs",
    ),
    *_ignored("each row's reward is chosen by its data_source column", "data.reward_fn_key"),
    *_ignored("used only with multi-turn tools, which are not offered", "data.tool_config_path"),
    *_ignored("validation prompts are taken in order", "data.validation_shuffle"),
    *_ignored(
        "prompts are generated data.train_batch_size at a time; dynamic sampling (algorithm.filter_groups) draws "
        "further batches as it needs them",
        "data.gen_batch_size",
    ),
    *_ignored("the tokenizer is loaded with actor_rollout_ref.model.trust_remote_code", "data.trust_remote_code"),
    *_ignored(
        "the tokenizer's chat template is applied with its defaults",
        "data.apply_chat_template_kwargs",
        "data.apply_chat_template_kwargs.*",
    ),
    *_refused(
        "limiting the number of rows read (train/val_max_samples)",
        "data.train_max_samples",
        "data.val_max_samples",
        off=(-1, None),
    ),
    *_refused("custom dataset classes (data.custom_cls)", "data.custom_cls.path", off=(None,)),
    *_refused("custom samplers and curricula (data.sampler)", "data.sampler.class_path", off=(None,)),
    *_refused("generated data (data.datagen)", "data.datagen.path", off=(None,)),
    *_ignored(
        "used only with the custom class above", "data.custom_cls.name", "data.sampler.class_name", "data.datagen.name"
    ),
    # ---- algorithm -------------------------------------------------------------------------------------
    *_ignored(
        "used only by kl_ctrl.type=adaptive, which is not offered",
        "algorithm.kl_ctrl.horizon",
        "algorithm.kl_ctrl.target_kl",
    ),
    *_refused(
        "per-component rewards for gdpo (the scorer keeps one number per response: a custom reward's dict gives "
        "its 'score' and drops the other keys, verl's reward_extra_info that gdpo_reward_keys names; without "
        "them gdpo normalises the one score)",
        "algorithm.gdpo_reward_keys",
        "algorithm.gdpo_reward_weights",
        off=(None, []),
    ),
    *_refused("preference-feedback PPO (use_pf_ppo)", "algorithm.use_pf_ppo", off=(False,)),
    *_ignored("used only with use_pf_ppo", "algorithm.pf_ppo.*"),
    # ---- reward --------------------------------------------------------------------------------------------
    *_ignored("rewards are computed in the trainer's process", "reward_model.launch_reward_fn_async"),
    *_ignored(
        REWARD_MODEL,
        *(
            f"reward_model.{k}"
            for k in (
                "enable_resource_pool",
                "n_gpus_per_node",
                "nnodes",
                "strategy",
                "model.*",
                "micro_batch_size",
                "micro_batch_size_per_gpu",
                "max_length",
                "use_dynamic_bsz",
                "forward_max_token_len_per_gpu",
                "profiler.*",
                "nccl_timeout",
                "megatron.*",
                "load_weight",
                "sandbox_fusion.*",
                "use_reward_loop",
                "num_workers",
                "rollout.*",
                "ulysses_sequence_parallel_size",
            )
        ),
    ),
    # ---- critic, trainer, Ray ------------------------------------------------------------------------------
    *_refused("a critic (value model), as PPO with GAE uses", "critic.enable", off=(None, False)),
    ForeignKey("critic.*", NO_CRITIC),
    ForeignKey("trainer.critic_warmup", NO_CRITIC),
    ForeignKey("trainer.max_critic_ckpt_to_keep", NO_CRITIC),
    *_ignored("rows are split over data-parallel ranks in order, not balanced by length", "trainer.balance_batch"),
    *_ignored(
        "validation metrics are logged; generations are kept in the evaluation records", "trainer.log_val_generations"
    ),
    *_ignored("used by verl's elastic training on ByteDance's cluster", "trainer.esi_redundant_time"),
    *_ignored(
        "checkpoints are kept after loading; trainer.max_actor_ckpt_to_keep prunes old ones",
        "trainer.del_local_ckpt_after_load",
    ),
    *_refused(
        "uploading checkpoints to HDFS (copy trainer.default_local_dir instead)",
        "trainer.default_hdfs_dir",
        off=(None,),
    ),
    *_ignored(NO_RAY, "trainer.ray_wait_register_center_timeout", "ray_kwargs.*", "transfer_queue.*"),
    *_ignored(
        "generations are kept in metrics and the evaluation records, not dumped per step",
        "trainer.rollout_data_dir",
        "trainer.validation_data_dir",
    ),
]


PRESET_TRANSFORMER_KEYS = ("recompute_granularity", "recompute_modules", "recompute_method", "recompute_num_layers")
"""override_transformer_config keys verl's defaults already hold, so its users set them without Hydra's ``+``."""


def find(key: str) -> ForeignKey | None:
    """The entry for a verl key that is not one of this project's settings, or None (an unknown key)."""
    for entry in IGNORED_AND_REFUSED:
        if fnmatchcase(key, entry.pattern):
            return entry
    return None


def concrete_keys() -> list[str]:
    """The table's keys without wildcards, for "did you mean" on typos."""
    return [e.pattern for e in IGNORED_AND_REFUSED if "*" not in e.pattern]


REFUSED_VALUES: dict[tuple[str, Any], str] = {
    (f"{ARR}.actor.strategy", "fsdp"): "the FSDP training backend (the actor trains on megatron-core)",
    (f"{ARR}.actor.strategy", "fsdp2"): "the FSDP2 training backend (the actor trains on megatron-core)",
    (f"{ARR}.rollout.name", "sglang"): "the SGLang rollout engine",
    (f"{ARR}.rollout.name", "trtllm"): "the TensorRT-LLM rollout engine",
    ("algorithm.adv_estimator", "gae"): "GAE, which needs a critic (value model)",
    ("algorithm.kl_ctrl.type", "adaptive"): "the adaptive in-reward KL controller",
    ("reward_model.reward_manager", "prime"): "PRIME's reward manager",
    ("reward_model.reward_manager", "batch"): "the batch reward manager",
}
"""Values of implemented keys that select one of verl's features not offered: the refusal names the feature."""
