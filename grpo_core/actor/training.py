"""What makes the actor trainable: megatron's DDP around each model chunk (less its gradient reduction in a
one-process run), the optimizer and the learning-rate schedule, each built from ``ActorSettings``."""

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from grpo_core.actor.settings import ActorSettings
from grpo_core.models import fused
from grpo_core.models.bridge import DTYPES


def optimizer_fields(optimizer_offload: bool, overrides: dict | None, cuda: bool) -> dict:
    """OptimizerConfig fields on top of the actor's own: ``optimizer_offload`` is shorthand for megatron's
    whole-step CPU offload, and ``override_optimizer_config`` comes after it (verl's order), so its keys win.
    Without CUDA the states are in host memory already and megatron's offload path (a GPU/CPU hybrid) cannot
    run: it stays off."""
    fields = {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.0} if optimizer_offload else {}
    fields.update(overrides or {})
    if not cuda and fields.get("optimizer_cpu_offload"):
        fields["optimizer_cpu_offload"] = False
    return fields


class DDP(DistributedDataParallel):
    """megatron's DDP, less its gradient reduction when the run is one process: a collective over one rank still
    copies every fp32 gradient (gloo on a CPU: the 538 MB buffer twice, 0.1-0.25 s of the demo's 5 s update)."""

    def _make_backward_post_hook(self, param: torch.nn.Parameter):
        """megatron's hook, the gradient added to ``main_grad`` first in one compiled pass where that is faster
        (``fused.accumulate``: bf16 on CPUs) and no bucket's reduction waits on the hook."""
        hook = super()._make_backward_post_hook(param)
        if self.ddp_config.overlap_grad_reduce:
            return hook

        def accumulate_then_hook(*args):
            grad = param.grad
            if grad is not None and not param.grad_added_to_main_grad and fused.accumulate(param.main_grad, grad):
                param.grad = None  # added: megatron's hook has nothing left to add
            return hook(*args)

        return accumulate_then_hook

    def finish_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        if dist.get_world_size() > 1:
            super().finish_grad_sync(force_all_reduce=force_all_reduce)


def finalize_presummed_grads(model, num_tokens=None, **kwargs) -> None:
    """megatron's ``finalize_model_grads`` less its last pass, the division of every fp32 gradient by the
    summed token count (23 of 640 ms in a 7B fwd+bwd on an H200): each micro-batch's loss is already divided
    by the whole mini-batch's denominator (``MegatronActor._loss_scale``) before its backward."""
    finalize_model_grads(model, None, **kwargs)


def ddp_chunks(chunks: list[torch.nn.Module], config, s: ActorSettings) -> list[DDP]:
    """Each model chunk in DDP, its gradients in fp32 buckets."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        # with data parallelism, each bucket's reduce-scatter starts as soon as its gradients are ready,
        # under the rest of the last micro-batch's backward
        overlap_grad_reduce=s.layout.dp > 1,
        use_distributed_optimizer=s.use_distributed_optimizer,
    )
    return [DDP(config=config, ddp_config=ddp_config, module=chunk) for chunk in chunks]


def build_optimizer(model: list[DDP], s: ActorSettings) -> tuple[MegatronOptimizer, bool]:
    """(megatron's Adam over the DDP chunks, whether its step runs on the fused kernels)."""
    base = dict(
        optimizer="adam",
        lr=s.lr,
        min_lr=s.min_lr,
        weight_decay=s.weight_decay,
        adam_beta1=s.adam_beta1,
        adam_beta2=s.adam_beta2,
        clip_grad=s.grad_clip,
        bf16=s.dtype == "bfloat16",
        fp16=s.dtype == "float16",
        params_dtype=DTYPES[s.dtype],
        use_distributed_optimizer=s.use_distributed_optimizer,
        # fp16: start the dynamic loss scale lower than megatron's 2^32 and halve it on every overflow
        # (hysteresis 1), so a start that is too high costs few skipped updates.
        initial_loss_scale=s.initial_loss_scale,
        hysteresis=1,
    )
    extra = optimizer_fields(s.optimizer_offload, s.optimizer_overrides, torch.cuda.is_available())
    opt_config = OptimizerConfig(**{**base, **extra})
    fused.install_optimizer_kernels()
    optimizer = get_megatron_optimizer(opt_config, model)
    return optimizer, not opt_config.optimizer_cpu_offload and fused.use_fused_adam(optimizer)


def build_scheduler(optimizer: MegatronOptimizer, s: ActorSettings) -> OptimizerParamScheduler:
    """The learning rate's warm-up and decay over the run's optimizer steps; a constant weight decay."""
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if s.lr_warmup_steps else s.lr,
        max_lr=s.lr,
        min_lr=s.min_lr,
        lr_warmup_steps=s.lr_warmup_steps,
        lr_decay_steps=max(s.total_optimizer_steps, 1),
        lr_decay_style=s.lr_decay_style,
        start_wd=s.weight_decay,
        end_wd=s.weight_decay,
        wd_incr_steps=max(s.total_optimizer_steps, 1),
        wd_incr_style="constant",
    )
