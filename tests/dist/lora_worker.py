"""Run by torchrun (2 processes) from tests/test_lora.py: LoRA on the megatron actor, per model and layout.

For each Hugging Face model given and each layout (TP1 DP2, TP2, TP2 with sequence parallelism, PP2, CP2): the adapters as initialised, in peft's names; the
log-probs of a fixed batch with them and without (the base, the reference of a LoRA run); the gradients of one
on-policy GRPO mini-batch (A and B, in peft's names); then one update: whether every base weight is bit-identical
after it, which parameters megatron's DDP and optimizer hold, the adapters after, and the merged HF weights the
rollout engines get; and the log-probs of a fresh actor of that layout with the adapters after the step loaded in
peft's names (a warm start from an adapter). Rank 0 writes it all as JSON (safetensors for the tensors)."""

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from safetensors.torch import save_file

from grpo_core.actor.actor import ActorSettings, MegatronActor
from grpo_core.actor.loss import LossSettings
from grpo_core.actor.parallel import init_distributed, init_model_parallel
from grpo_core.data.batch import RolloutBatch
from grpo_core.models.adapter import Adapter
from grpo_core.models.bridge import gather_hf_weights, load_peft_adapter, peft_adapter_tensors
from grpo_core.models.lora import LoRASettings, adapters
from grpo_core.models.shape import load_model_shape
from grpo_core.planning.layout import ParallelLayout

LOSS = LossSettings(kl_loss_coef=0.0, use_kl_loss=False, entropy_coeff=0.0, clip_ratio=0.2)
LORA = LoRASettings(rank=4, alpha=8.0, a_init="kaiming", b_init="kaiming", seed=3)  # B non-zero: the adapters act


def synthetic_batch(vocab: int, rows: int = 8, prompt: int = 5, response: int = 4) -> RolloutBatch:
    """Left-padded prompts, right-padded responses, advantages of both signs."""
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, vocab, (rows, prompt + response), generator=g)
    attention = torch.ones(rows, prompt + response, dtype=torch.long)
    response_mask = torch.ones(rows, response)
    for i in range(rows):
        attention[i, : i % 3] = 0
        length = response - (i % 3)
        response_mask[i, length:] = 0
        attention[i, prompt + length :] = 0
    advantages = torch.linspace(-1.0, 1.0, rows)[:, None] * response_mask
    return RolloutBatch(ids, attention, response_mask, advantages=advantages)


def gradients_in_peft_names(actor: MegatronActor, shape) -> dict[str, torch.Tensor]:
    """Each adapter's A and B gradient (megatron's fp32 main_grad), named and cut as peft names the adapters."""
    found = adapters(actor.model)
    kept = [(a.A.data, a.B.data) for a in found]
    for a in found:
        a.A.data, a.B.data = a.A.main_grad.to(a.A.dtype), a.B.main_grad.to(a.B.dtype)
    try:
        return peft_adapter_tensors(actor.model, shape)
    finally:
        for a, (da, db) in zip(found, kept, strict=True):
            a.A.data, a.B.data = da, db


def adam_numel(optimizer) -> int:
    """Elements of Adam's first moment this rank keeps, over megatron's chained optimizers."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return sum(s["exp_avg"].numel() for o in parts for s in o.optimizer.state.values() if "exp_avg" in s)


LAYOUTS = {
    "tp1": (1, 1, False, 1),
    "tp2": (2, 1, False, 1),
    "tp2sp": (2, 1, True, 1),
    "pp2": (1, 2, False, 1),
    "cp2": (1, 1, False, 2),
}
"""name -> (TP, PP, sequence parallelism, CP); DP = 2 / (TP x PP x CP)."""


def run(name: str, hf_dir: str, layout_name: str, world: int, out: str) -> dict:
    shape = load_model_shape(hf_dir)
    tp, pp, sp, cp = LAYOUTS[layout_name]
    layout = ParallelLayout(world_size=world, tp=tp, pp=pp, cp=cp)
    init_model_parallel(layout, seed=7)
    settings = ActorSettings(
        sequence_parallel=sp,
        layout=layout,
        lr=1e-3,  # Adam moves elements of ~0 gradient by ~lr whatever their size: TP rounding shows at ~lr/1000
        weight_decay=0.0,
        mini_batch_rows=8,
        micro_batch_rows=4,
        use_distributed_optimizer=layout.dp == 1,  # at DP=2 the plain optimizer: whole gradients on every rank
        loss=LOSS,
        lora=LORA,
    )
    actor = MegatronActor(shape, settings, hf_path=hf_dir)
    named = [(n, p) for chunk in actor.model for n, p in chunk.module.named_parameters()]
    frozen = {n: p.detach().clone() for n, p in named if ".lora." not in n}
    trainable = sorted(n for n, p in named if p.requires_grad)
    buffered = {id(p) for chunk in actor.model for b in chunk.buffers for p in b.params}
    batch = synthetic_batch(shape.vocab_size)
    before = peft_adapter_tensors(actor.model, shape)
    log_probs, _ = actor.compute_log_prob(batch)
    base_log_probs, _ = actor.compute_log_prob(batch, base=True)
    batch.old_log_probs = log_probs  # on-policy: the ratio is 1, the loss's gradient -sum(adv * grad log p) / tokens
    actor.forward_backward(batch)
    grads = gradients_in_peft_names(actor, shape)
    metrics = actor.update(batch)
    after = peft_adapter_tensors(actor.model, shape)
    _, stream = gather_hf_weights(actor.model, shape, dst=0)
    merged = dict(stream)
    log_probs_after, _ = actor.compute_log_prob(batch)
    base_after, _ = actor.compute_log_prob(batch, base=True)
    named_after = dict(named)
    # the adapters after the step, as `grpo export --peft` writes them, loaded into a fresh actor of this layout
    # (model.lora.adapter_path: each rank slices its shards of B or A as it slices the weights)
    shared = [after]
    dist.broadcast_object_list(shared, src=0)
    fresh = MegatronActor(shape, settings, hf_path=hf_dir, trainable=False)
    load_peft_adapter(fresh.model, shape, Adapter(Path(out), LORA.rank, LORA.alpha, hf_dir, shared[0]))
    log_probs_loaded, _ = fresh.compute_log_prob(batch)
    lora_numel = sum(p.numel() for n, p in named if ".lora." in n)
    result = {
        "trainable_all_adapters": all(".lora." in n for n in trainable) and len(trainable) > 0,
        "buffers_hold_only_adapters": {id(p) for n, p in named if ".lora." in n} == buffered,
        "adam_numel": adam_numel(actor.optimizer),
        # the distributed optimizer shards Adam's state over DP x CP
        "adam_shards": ps.get_data_parallel_world_size(with_context_parallel=True) if layout.dp == 1 else 1,
        "lora_numel": lora_numel,
        "sequence_parallel": all(a.sequence_parallel for a in adapters(actor.model)),
        "base_unchanged": all(torch.equal(named_after[n], t) for n, t in frozen.items()),
        "log_probs": log_probs.tolist(),
        "base_log_probs": base_log_probs.tolist(),
        "log_probs_after": log_probs_after.tolist(),
        "log_probs_loaded": log_probs_loaded.tolist(),
        "base_after_change": (base_after - base_log_probs).abs().max().item(),
        "grad_norm": metrics["actor/grad_norm"],
        "response_mask": batch.response_mask.tolist(),
        "input_ids": batch.input_ids.tolist(),
        "attention_mask": batch.attention_mask.tolist(),
        "advantages": batch.advantages.tolist(),
    }
    if dist.get_rank() == 0:
        key = f"{name}_{layout_name}"
        for part, tensors in (("before", before), ("grads", grads), ("after", after), ("merged", merged)):
            save_file({k: v.contiguous() for k, v in tensors.items()}, f"{out}/{key}_{part}.safetensors")
    return result


def checkpoint_round_trip(hf_dir: str, world: int, out: str) -> dict:
    """A LoRA actor at TP2 with sequence parallelism steps once and is saved (adapters and Adam state); an actor at
    TP1 (DP2) loads it: the same log-probs, and the same next update as the TP2 actor's."""
    from grpo_core.checkpoint.manager import CheckpointManager

    shape = load_model_shape(hf_dir)
    batch = synthetic_batch(shape.vocab_size)
    numbers = {}
    for layout_name in ("tp2sp", "tp1"):
        tp, pp, sp, _ = LAYOUTS[layout_name]
        layout = ParallelLayout(world_size=world, tp=tp, pp=pp)
        init_model_parallel(layout, seed=7)
        settings = ActorSettings(layout=layout, sequence_parallel=sp, lr=1e-3, loss=LOSS, lora=LORA, mini_batch_rows=8)
        actor = MegatronActor(shape, settings, hf_path=hf_dir)
        manager = CheckpointManager(f"{out}/checkpoints")
        if layout_name == "tp2sp":
            batch.old_log_probs = actor.compute_log_prob(batch)[0]
            actor.update(batch)
            manager.save(1, actor, {"hf_config": {}})
        else:
            manager.load(manager.latest(), actor)
        log_probs = actor.compute_log_prob(batch)[0]
        numbers[f"{layout_name}_loaded" if layout_name == "tp1" else "tp2sp_saved"] = log_probs.tolist()
        batch.old_log_probs = log_probs
        numbers[f"{layout_name}_next_grad_norm"] = actor.update(batch)["actor/grad_norm"]
        numbers[f"{layout_name}_next"] = actor.compute_log_prob(batch)[0].tolist()
    numbers["response_mask"] = batch.response_mask.tolist()
    return numbers


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", required=True, help="name=hf_dir,...")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    init_distributed()
    world = dist.get_world_size()
    results = {}
    for spec in args.models.split(","):
        name, hf_dir = spec.split("=", 1)
        for layout_name in LAYOUTS:
            results[f"{name}_{layout_name}"] = run(name, hf_dir, layout_name, world, args.out)
    results["checkpoint"] = checkpoint_round_trip(args.models.split(",")[0].split("=", 1)[1], world, args.out)
    if dist.get_rank() == 0:
        with open(f"{args.out}/results.json", "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
