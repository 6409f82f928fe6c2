"""The policy on megatron-core: log-probs and the GRPO update, on any TP/PP/DP layout.

One class for both roles: the actor (trainable: DDP, distributed optimizer, lr schedule: training.py) and the
frozen reference (no gradients, no optimizer). Every rank holds the whole rollout batch; each data-parallel
rank works on its own slice and results are gathered back, so callers never see the layout.
"""

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from grpo_core.actor import offload, optimizer_state, training
from grpo_core.actor.logprobs import log_probs_and_entropy
from grpo_core.actor.loss import grpo_loss
from grpo_core.actor.packing import PackedRows, pack, packed_length, split_by_tokens
from grpo_core.actor.parallel import device, send
from grpo_core.actor.settings import ActorSettings
from grpo_core.algos import agg_denominator
from grpo_core.data.batch import RolloutBatch
from grpo_core.models import context_parallel, fused
from grpo_core.models.adapter import read_adapter
from grpo_core.models.bridge import (
    DTYPES,
    build_model,
    load_hf_weights,
    load_peft_adapter,
    logits_at,
    transformer_config,
)
from grpo_core.models.lora import adapters_disabled, apply_lora, is_adapter_param
from grpo_core.models.packed import packed_weights
from grpo_core.models.shape import ModelShape
from grpo_core.numerics import NotFinite, finite_each


def epoch_orders(rows: int, epochs: int, stepped: int, generator: torch.Generator) -> list[torch.Tensor]:
    """actor.shuffle: each PPO epoch's order of the rows, which its mini-batches take in turn. A permutation per
    epoch, but the first keeps its ``stepped`` rows (mini-batches already stepped on: an on-policy update's first)
    in front."""
    orders = []
    for epoch in range(epochs):
        kept = stepped if epoch == 0 else 0
        orders.append(torch.cat([torch.arange(kept), kept + torch.randperm(rows - kept, generator=generator)]))
    return orders


def rows_in_budget(batch_rows: int, width: int, tokens: int) -> int:
    """Rows per micro-batch for a token budget where every micro-batch must have one shape (pipeline stages,
    unpacked rows): the most rows of ``width`` tokens within ``tokens`` that divide the batch evenly (at least 1)."""
    most = max(1, tokens // width)
    return max(n for n in range(1, min(most, batch_rows) + 1) if batch_rows % n == 0)


def causal_padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[b, s] (1 = token) -> [b, 1, s, s] bool, True = masked, as megatron expects.

    A padding query still attends to itself, so no row is fully masked (that would give NaN)."""
    s = attention_mask.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=attention_mask.device).triu(1)
    masked = causal[None, None] | (attention_mask[:, None, None, :] == 0)
    return masked & ~torch.eye(s, dtype=torch.bool, device=attention_mask.device)


@dataclass
class MicroBatch:
    rows: RolloutBatch
    packed: PackedRows | None = None  # the rows as one packed sequence (see actor/packing.py)
    # whether an unpacked row pads, read on the host: on the device it would cost a sync per micro-batch
    pads: bool = True

    def map(self, fn) -> "MicroBatch":
        return replace(self, rows=self.rows.map(fn), packed=self.packed and self.packed.map(fn))


class MegatronActor:
    def __init__(
        self,
        shape: ModelShape,
        settings: ActorSettings,
        hf_path: str | None = None,
        trainable: bool = True,
        adapter_path: str | None = None,
    ):
        """``adapter_path``: a PEFT adapter directory the LoRA adapters start from (``model.lora.adapter_path``)."""
        self.shape, self.s, self.trainable = shape, settings, trainable
        layout = settings.layout
        self.config = transformer_config(
            shape,
            tp=layout.tp,
            pp=layout.pp,
            cp=layout.cp,
            ep=layout.ep,
            etp=layout.etp,
            sequence_parallel=settings.sequence_parallel and layout.tp > 1,
            dtype=settings.dtype,
            recompute="full" if settings.recompute else None,
            overrides=settings.transformer_overrides,
        )
        self.config.calculate_per_token_loss = True  # see actor/loss.py: (sum, denominator) per micro-batch
        if layout.pp > 1:
            self.config.pipeline_dtype = DTYPES[settings.dtype]
        self.model = self._build_chunks()
        self._param_host = offload.HostOffloader(frozen=not trainable)
        self._grad_host = offload.HostOffloader()
        self._optimizer_host = offload.HostOffloader()
        if hf_path is not None:
            for chunk in self.model:
                load_hf_weights(chunk, hf_path, shape)
        if settings.lora.enabled:  # after the weights, before DDP and the optimizer see the params
            for chunk in self.model:
                apply_lora(chunk, settings.lora)
            if adapter_path is not None:
                load_peft_adapter(self.model, shape, read_adapter(adapter_path))
        if trainable:
            self._wrap_for_training()
        else:
            for chunk in self.model:
                chunk.requires_grad_(False)
                chunk.eval()

    def _build_chunks(self) -> list[torch.nn.Module]:
        vpp = self.s.layout.vpp
        # the project's spec for LoRA (adapters on megatron's own linears) and CP (models/context_parallel.py)
        use_te = False if self.s.lora.enabled or self.s.layout.cp > 1 else None
        if vpp is None:
            return [build_model(self.shape, self.config, use_te=use_te).to(device())]
        return [build_model(self.shape, self.config, vp_stage=i, use_te=use_te).to(device()) for i in range(vpp)]

    def _wrap_for_training(self) -> None:
        self.model = training.ddp_chunks(self.model, self.config, self.s)
        self.optimizer, self._fused_adam = training.build_optimizer(self.model, self.s)
        self.scheduler = training.build_scheduler(self.optimizer, self.s)
        self.config.finalize_model_grads_func = training.finalize_presummed_grads
        self.config.grad_scale_func = self.optimizer.scale_loss
        self.config.no_sync_func = [chunk.no_sync for chunk in self.model]
        if len(self.model) == 1:
            self.config.no_sync_func = self.config.no_sync_func[0]

    # ---- forward ----------------------------------------------------------------------------------

    def _sequence_multiple(self) -> int:
        """Sequence parallelism splits the sequence over TP ranks, context parallelism over 2*CP chunks."""
        layout = self.s.layout
        return (layout.tp if self.config.sequence_parallel else 1) * (2 * layout.cp if layout.cp > 1 else 1)

    def _padded_length(self, length: int) -> int:
        multiple = self._sequence_multiple()
        return -(-length // multiple) * multiple

    def _forward(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        if mb.packed is not None:  # logits only at the positions predicting response tokens (not with SP)
            positions = None if self.config.sequence_parallel else mb.packed.logit_index.reshape(-1)
            with logits_at(model, positions):
                return model(mb.packed.input_ids, None, None, packed_seq_params=mb.packed.params)
        ids, attn = mb.rows.input_ids, mb.rows.attention_mask
        pad = self._padded_length(ids.shape[1]) - ids.shape[1]
        if pad:
            ids = torch.nn.functional.pad(ids, (0, pad))
            attn = torch.nn.functional.pad(attn, (0, pad))
        positions = (attn.long().cumsum(-1) - 1).clamp(min=0)
        # No padding at all: no mask, so attention takes the causal fast path (flash kernels on GPU).
        mask = causal_padding_mask(attn) if mb.pads or pad else None
        if self.s.layout.cp > 1:  # this CP rank's chunks of the tokens; its queries' rows of the mask
            ids, positions = context_parallel.local(ids, 1), context_parallel.local(positions, 1)
            mask = None if mask is None else context_parallel.local(mask, 2)
        return model(ids, positions, mask)

    def _response_log_probs(self, logits: torch.Tensor, mb: MicroBatch, entropy_grad: bool):
        """(log-prob, entropy) [rows, R] of each response token, from the logits one position before it. Packed,
        the model computed those positions' logits only (``_forward``); otherwise they are taken at every position
        (of its next token) and the responses' picked out after. Either way the kernels read the logits as one
        contiguous [tokens, vocab] block and the backward writes their gradient in one pass."""
        if mb.packed is not None and not self.config.sequence_parallel:  # logits at those positions only (_forward)
            index = mb.packed.logit_index
            targets = mb.packed.input_ids.roll(-1, dims=1)[:, index.reshape(-1)]
            lp, ent = log_probs_and_entropy(logits, targets, self.shape.vocab_size, entropy_grad=entropy_grad)
            return lp.view(index.shape), ent.view(index.shape)
        ids = mb.packed.input_ids if mb.packed is not None else mb.rows.input_ids
        cp = self.s.layout.cp
        targets = torch.nn.functional.pad(ids, (0, logits.shape[1] * cp - ids.shape[1])).roll(-1, dims=1)
        if cp > 1:  # this CP rank's positions, then whole rows again: every loss reads whole sequences
            targets = context_parallel.local(targets, 1)
        lp, ent = log_probs_and_entropy(logits, targets, self.shape.vocab_size, entropy_grad=entropy_grad)
        if cp > 1:
            lp, ent = (context_parallel.gather(t, 1, sum_grads=False) for t in (lp, ent))
        if mb.packed is not None:
            return lp[0][mb.packed.logit_index], ent[0][mb.packed.logit_index]
        total, r = mb.rows.input_ids.shape[1], mb.rows.response_length
        return lp[:, total - r - 1 : total - 1], ent[:, total - r - 1 : total - 1]

    def _micro_batches(self, batch: RolloutBatch, rows: int, tokens: int | None = None) -> list[MicroBatch]:
        """``rows`` at a time, or as many as fit ``tokens`` when given; packed or without the prompt columns all
        rows pad. Pipeline stages exchange fixed-shape activations, so with PP > 1 every micro-batch has one
        width: the longest packed row, or the batch's width unpacked. Built where the rows are (a rollout batch
        lives on the host, where the lengths they are cut by are read without a GPU sync), then sent."""
        s, pp = self.s, self.s.layout.pp
        if tokens is not None and pp > 1 and not s.pack_sequences:  # one shape: as many whole rows as tokens hold
            rows, tokens = rows_in_budget(batch.batch_size, self._padded_length(batch.input_ids.shape[1]), tokens), None
        groups = batch.split(rows) if tokens is None else split_by_tokens(batch, tokens, packed=s.pack_sequences)
        if s.pack_sequences:
            multiple = self._sequence_multiple()
            length = max(packed_length(g, multiple) for g in groups) if pp > 1 else None
            micro = [MicroBatch(g, pack(g, multiple, length)) for g in groups]
        else:
            rows = [g.without_leading_padding() if pp == 1 else g for g in groups]
            micro = [MicroBatch(r, pads=not bool(r.attention_mask.all())) for r in rows]
        return [mb.map(send) for mb in micro]

    def _run(self, batches: list[MicroBatch], step_fn, forward_only: bool) -> list[dict]:
        """Micro-batches through megatron's pipeline schedule; the loss dicts of the last stage."""
        iterators: list[Iterator] = [iter(batches) for _ in self.model]
        first = batches[0]
        if first.packed is not None:
            seq_length, rows = first.packed.length, 1
        else:
            seq_length, rows = self._padded_length(first.rows.input_ids.shape[1]), first.rows.batch_size
        with packed_weights():  # bf16 CPUs: each weight packed once for all the micro-batches (models/packed.py)
            return get_forward_backward_func()(
                forward_step_func=step_fn,
                data_iterator=iterators if len(iterators) > 1 else iterators[0],
                model=self.model if len(self.model) > 1 else self.model[0],
                num_microbatches=len(batches),
                seq_length=seq_length,
                micro_batch_size=rows,
                forward_only=forward_only,
            )

    # ---- data-parallel plumbing -------------------------------------------------------------------

    def _dp_slice(self, batch: RolloutBatch) -> RolloutBatch:
        dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        if batch.batch_size % dp:
            raise ValueError(f"{batch.batch_size} rows do not split over DP={dp}")
        per_rank = batch.batch_size // dp
        return batch.rows(slice(rank * per_rank, (rank + 1) * per_rank))

    def _from_last_stage(self, t: torch.Tensor) -> torch.Tensor:
        if ps.get_pipeline_model_parallel_world_size() > 1:
            last = ps.get_pipeline_model_parallel_last_rank()
            dist.broadcast(t, src=last, group=ps.get_pipeline_model_parallel_group())
        return t

    def _gather_dp(self, t: torch.Tensor) -> torch.Tensor:
        dp = ps.get_data_parallel_world_size()
        if dp == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(dp)]
        dist.all_gather(parts, t.contiguous(), group=ps.get_data_parallel_group())
        return torch.cat(parts)

    # ---- public -----------------------------------------------------------------------------------

    @torch.no_grad()
    def compute_log_prob(
        self,
        batch: RolloutBatch,
        micro_batch_rows: int | None = None,
        micro_batch_tokens: int | None = None,
        base: bool = False,
    ):
        """(log-probs, entropy) of every response token, [B, R] each, on every rank. Micro-batches of
        ``micro_batch_rows`` (default: the update's) or, when given, of ``micro_batch_tokens`` tokens (verl's
        ``log_prob_use_dynamic_bsz`` + ``log_prob_max_token_len_per_gpu``). ``base``: with the LoRA adapters off,
        i.e. the reference policy of a LoRA run (no second model is loaded for it)."""
        if base:
            with adapters_disabled(self.model):
                return self.compute_log_prob(batch, micro_batch_rows, micro_batch_tokens)
        self.reload_parameters()  # gradients and optimizer stay away
        for chunk in self.model:
            chunk.eval()
        local = self._dp_slice(batch)
        micro = self._micro_batches(local, micro_batch_rows or self.s.micro_batch_rows, micro_batch_tokens)

        def step(data_iterator, model):
            mb = next(data_iterator)

            def collect(output):
                lp, ent = self._response_log_probs(output, mb, entropy_grad=False)
                return output.new_zeros(()), {"log_probs": lp, "entropy": ent}

            return self._forward(model, mb), collect

        return self._assemble_log_probs(self._run(micro, step, forward_only=True), local)

    def _assemble_log_probs(self, outputs: list[dict], local: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batches' (log-probs, entropy), in row order, [B, R] each on every rank (on the host)."""
        shape = (local.batch_size, local.response_length)
        log_probs = torch.zeros(shape, device=device())
        entropy = torch.zeros(shape, device=device())
        if outputs:  # the last pipeline stage
            log_probs = torch.cat([o["log_probs"] for o in outputs]).float()
            entropy = torch.cat([o["entropy"] for o in outputs]).float()
        log_probs, entropy = self._from_last_stage(log_probs), self._from_last_stage(entropy)
        return self._gather_dp(log_probs).cpu(), self._gather_dp(entropy).cpu()

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """PPO epochs x mini-batches of the GRPO loss; one optimizer step per mini-batch."""
        self._train_mode()
        return self._steps(batch, [])

    def update_on_policy(
        self, batch: RolloutBatch, later: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[dict[str, float], torch.Tensor, torch.Tensor]:
        """``update`` for a batch this policy sampled: until its first optimizer step the policy being updated is
        the old one, so the first mini-batch's forward gives that mini-batch's old log-probs and a separate pass
        over its rows would compute the same numbers (verl's on-policy actor path; NeMo-RL's
        ``force_on_policy_ratio``); its ratio is exactly 1. ``later``: (log-probs, entropy) of the rows after the
        first mini-batch from ``compute_log_prob`` before this call (None when the batch is one mini-batch).
        Returns the metrics and every row's old log-probs and entropy, [B, R] each."""
        first = self.s.mini_batch_rows
        if (later is None) != (batch.batch_size <= first):
            raise ValueError(f"later log-probs are for rows after the first mini-batch ({first} of {batch.batch_size})")
        head = replace(batch.rows(slice(0, first)), old_log_probs=None)
        self._train_mode()
        outputs = self.forward_backward(head)
        log_probs, entropy = self._assemble_log_probs(outputs, self._dp_slice(head))
        history = [self._optimizer_step(outputs)]
        if later is not None:
            log_probs, entropy = torch.cat([log_probs, later[0]]), torch.cat([entropy, later[1]])
        return self._steps(replace(batch, old_log_probs=log_probs), history), log_probs, entropy

    def _steps(self, batch: RolloutBatch, history: list[dict[str, float]]) -> dict[str, float]:
        """The mini-batch steps of every epoch after the ``len(history)`` already taken; their mean metrics."""
        epochs = [batch] * self.s.ppo_epochs
        if self.s.shuffle_seed is not None:  # a stream per update, from the step count: a resumed run draws alike
            generator = torch.Generator().manual_seed(self.s.shuffle_seed * 1_000_003 + self.scheduler.num_steps)
            stepped = len(history) * self.s.mini_batch_rows
            orders = epoch_orders(batch.batch_size, self.s.ppo_epochs, stepped, generator)
            epochs = [batch.rows(order) for order in orders]
        minis = [mini for rows in epochs for mini in rows.split(self.s.mini_batch_rows)]
        for mini in minis[len(history) :]:
            history.append(self._optimizer_step(self.forward_backward(mini)))
        return self._mean_metrics(history)

    def _train_mode(self) -> None:
        assert self.trainable, "the reference model is frozen"
        self.reload_from_host()
        for chunk in self.model:
            chunk.train()

    def _optimizer_step(self, outputs: list[dict]) -> dict:
        """The step on the gradients ``forward_backward`` left (``outputs``: its loss dicts); its metrics, the loss
        terms' sums still on the GPU (``_mean_metrics`` reads them once the update is over). NotFinite, with no
        step taken, when any rank's gradients or loss terms hold NaN or infinity: megatron's bf16 and fp32
        optimizers would apply them and every weight would be NaN after it."""
        sums = self._metric_sums(outputs)
        if not self._finite(sums):
            self.optimizer.zero_grad()
            raise NotFinite(
                f"optimizer step {self.scheduler.num_steps + 1}: the loss or its gradients hold NaN or infinity "
                "(a reward, advantage or log-probability that is not a number, or a learning rate too high); the "
                "update was skipped and the run stopped"
            )
        _, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        metrics: dict = {"sums": sums}
        metrics["actor/grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")  # nan: skipped
        if self.s.dtype == "float16":
            metrics["actor/loss_scale"] = float(self.optimizer.get_loss_scale())
        metrics["actor/lr"] = self.optimizer.param_groups[0]["lr"]
        return metrics

    def _finite(self, sums: torch.Tensor) -> bool:
        """Whether every rank's gradient buffers and loss sums are numbers: a reduction per buffer, one
        all-reduce and one host sync (the step reads the gradient norm on the host anyway). In float16 an
        overflowing gradient is the loss scaler's to handle (it skips that step and lowers the scale)."""
        grads = [b.grad_data for chunk in self.model for b in chunk.buffers + chunk.expert_parallel_buffers]
        if self.s.dtype == "float16":
            grads = []
        bad = (~finite_each([*grads, sums])).any().to(torch.int32)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return not bad.item()

    def non_finite_weights(self) -> tuple[list[str], bool]:
        """(this rank's parameters holding NaN or infinity, whether any rank has one): a reduction per tensor,
        one all-reduce, one host sync."""
        params = [(n, p) for _, chunk in self._unwrapped_chunks() for n, p in chunk.named_parameters()]
        flags = finite_each([p for _, p in params]).tolist()
        bad = [n for (n, _), finite in zip(params, flags, strict=True) if not finite]
        anywhere = torch.tensor([len(bad)], dtype=torch.int32, device=device())
        dist.all_reduce(anywhere, op=dist.ReduceOp.MAX)
        return bad, bool(anywhere.item())

    def forward_backward(self, mini: RolloutBatch) -> list[dict]:
        """The GRPO loss's gradients for one mini-batch, reduced over DP, in the grad buffers (no step). Without
        ``old_log_probs`` the policy being updated is the old one: its detached log-probs stand in, and each loss
        dict also carries them (``log_probs``, ``entropy``)."""
        micro = self._micro_batches(self._dp_slice(mini), self.s.micro_batch_rows, self.s.micro_batch_tokens)
        on_policy = mini.old_log_probs is None
        entropy_grad = self.s.loss.entropy_coeff != 0
        scale = self._loss_scale(micro)

        def step(data_iterator, model):
            mb = next(data_iterator)

            def loss_fn(output):
                lp, ent = self._response_log_probs(output, mb, entropy_grad)
                rows = mb.rows
                total, denom, metrics = grpo_loss(
                    lp,
                    ent,
                    lp.detach() if on_policy else rows.old_log_probs,
                    rows.advantages,
                    rows.response_mask,
                    rows.ref_log_probs,
                    self.s.loss,
                    rows.rollout_log_probs,
                    rows.rollout_is_weights,
                )
                metrics["denominator"] = denom
                if on_policy:
                    metrics |= {"log_probs": lp.detach(), "entropy": ent.detach()}
                return total * scale, denom.to(device=total.device, dtype=torch.int), metrics

            return self._forward(model, mb), loss_fn

        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        return self._run(micro, step, forward_only=False)

    def _loss_scale(self, micro: list[MicroBatch]) -> torch.Tensor:
        """1 / the loss normaliser of the whole mini-batch (its micro-batches' denominators summed over DP ranks),
        a GPU scalar: read on the host it would drain the GPU's queue before the mini-batch's forwards."""
        mode = self.s.loss.loss_agg_mode
        total = sum(agg_denominator(mb.rows.response_mask, mode).to(device(), torch.float64) for mb in micro)
        dist.all_reduce(total, group=ps.get_data_parallel_group())  # CP ranks share rows: each computes the loss
        return (1.0 / total.clamp(min=1)).float()

    # ---- offload ----------------------------------------------------------------------------------

    def offload_to_host(self, params: bool = False, grads: bool = False, optimizer: bool = False) -> int:
        """Free device memory until the next use (which reloads by itself); returns bytes freed."""
        freed = 0
        if params:
            freed += self._param_host.offload(offload.parameters(self.model))
        if grads and self.trainable:
            freed += self._grad_host.offload(offload.gradient_buffers(self.model))
        if optimizer and self.trainable:
            freed += self._optimizer_host.offload(offload.optimizer_tensors(self.optimizer))
        return freed

    def reload_parameters(self) -> int:
        """What a forward pass needs (log-probs, generation from the actor's weights)."""
        return self._param_host.reload()

    def reload_from_host(self) -> int:
        return self._param_host.reload() + self._grad_host.reload() + self._optimizer_host.reload()

    # ---- checkpoints ------------------------------------------------------------------------------

    def _unwrapped_chunks(self):
        """(checkpoint key, model chunk without DDP): keys then do not depend on DDP being there."""
        for i, chunk in enumerate(self.model):
            yield (f"model{i}" if len(self.model) > 1 else "model"), getattr(chunk, "module", chunk)

    @property
    def optimizer_format(self) -> str:
        """How checkpoints hold the distributed optimizer: gathered into model space, or each rank's own shards."""
        return "fully_reshardable" if self.s.reshardable_checkpoint else "dp_reshardable"

    def sharded_state_dict(
        self, is_loading: bool = False, optimizer_format: str | None = None, optimizer: bool = True
    ) -> dict:
        """Model (and, with ``optimizer``, the optimizer in ``optimizer_format``: the checkpoint's when loading)
        in megatron's dist-checkpoint form: the model loadable at another TP/PP/DP layout, the optimizer as its
        format allows."""
        self.reload_from_host()  # an offloaded tensor has no storage to save or load into
        state = {}
        for key, module in self._unwrapped_chunks():
            state[key] = module.sharded_state_dict()
            if self.s.lora.enabled:  # the frozen base is model.path's: a LoRA checkpoint holds the adapters only
                state[key] = {k: v for k, v in state[key].items() if is_adapter_param(k)}
        if self.trainable and optimizer:
            if is_loading:
                optimizer_state.zero_adam_states(self.optimizer)
            metadata = {"distrib_optim_sharding_type": optimizer_format or self.optimizer_format}
            state["optimizer"] = self.optimizer.sharded_state_dict(dict(state), is_loading, metadata=metadata)
        return state

    def scheduler_state(self) -> dict:
        """The lr schedule's position (plain numbers: stored in the checkpoint's JSON trainer state)."""
        return self.scheduler.state_dict() if self.trainable else {}

    def load_scheduler_state(self, state: dict) -> None:
        if self.trainable and state:
            self.scheduler.load_state_dict(state)

    def load_sharded_state_dict(self, state: dict) -> None:
        for key, module in self._unwrapped_chunks():
            if not self.s.lora.enabled:
                module.load_state_dict(state[key])
                continue
            result = module.load_state_dict(state[key], strict=False)  # the adapters; the base is model.path's
            missing = [k for k in result.missing_keys if is_adapter_param(k)]
            if missing or result.unexpected_keys:
                raise KeyError(f"LoRA adapters missing {missing[:3]} / unexpected {result.unexpected_keys[:3]}")
        if self.trainable and "optimizer" in state:
            optimizer_state.load(self.optimizer, state["optimizer"])
            if self._fused_adam:  # the checkpoint's param groups may say otherwise
                fused.use_fused_adam(self.optimizer)
        elif self.trainable:  # the weights alone: the optimizer's fp32 copies must follow them
            self.optimizer.reload_model_params()

    def _metric_names(self) -> list[str]:
        names = ["actor/pg_loss", "actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"]
        return [*names, "actor/kl_loss"] if self.s.loss.use_kl_loss else names

    def _metric_sums(self, outputs: list[dict]) -> torch.Tensor:
        """The loss terms and the denominator summed over micro-batches, one GPU vector (zeros off the last stage)."""
        columns = [*self._metric_names(), "denominator"]
        if not outputs:  # not the last pipeline stage
            return torch.zeros(len(columns), dtype=torch.float64, device=device())
        return torch.stack([torch.stack([out[c].detach().double() for c in columns]) for out in outputs]).sum(0)

    def _mean_metrics(self, history: list[dict]) -> dict[str, float]:
        """The optimizer steps' metrics averaged, each step's loss terms divided by its denominator, on every rank:
        their sums summed over DP ranks and read on the host together, one sync for the update."""
        sums = torch.stack([h["sums"] for h in history])
        dist.all_reduce(sums, group=ps.get_data_parallel_group())
        names = self._metric_names()
        steps = []
        for h, (*totals, denominator) in zip(history, self._from_last_stage(sums).tolist(), strict=True):
            terms = {name: total / max(denominator, 1.0) for name, total in zip(names, totals, strict=True)}
            steps.append(terms | {k: v for k, v in h.items() if k != "sums"})
        return {k: sum(step[k] for step in steps) / len(steps) for k in steps[0]}
