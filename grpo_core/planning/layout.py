"""The parallel layout (TP/PP/CP/EP/ETP/DP) of a run and the divisibility rules megatron-core enforces."""

from dataclasses import dataclass

from grpo_core.config.schema import GRPOConfig
from grpo_core.models.shape import ModelShape


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """KV heads one TP rank attends with: its share, or one when TP exceeds them.

    megatron-core (``SelfAttention``, ``num_query_groups_per_partition``) and vLLM both allow TP to be a
    multiple of the KV heads; then the ``TP / num_kv_heads`` ranks of one query group each use that group's
    whole KV head. megatron still splits the fused QKV weight evenly (rows cut through a group) and
    all-gathers the QKV output: only activations, KV caches and vLLM's weights hold replicas.
    """
    return max(num_kv_heads // tp, 1)


def tp_splits_kv_heads(num_kv_heads: int, tp: int) -> bool:
    """TP divides the KV heads, or is a multiple of them (each head then serves TP / num_kv_heads ranks)."""
    return num_kv_heads % tp == 0 or tp % num_kv_heads == 0


@dataclass(frozen=True)
class ParallelLayout:
    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    vpp: int | None = None

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def dp(self) -> int:
        """Data-parallel replicas of the dense weights."""
        return max(self.world_size // self.model_parallel, 1)

    @property
    def expert_dp(self) -> int:
        """Data-parallel replicas of each expert."""
        return max(self.world_size // (self.etp * self.ep * self.pp), 1)

    def describe(self) -> str:
        text = f"world={self.world_size} TP={self.tp} PP={self.pp} CP={self.cp} DP={self.dp}"
        if self.ep > 1 or self.etp > 1:
            text += f" EP={self.ep} ETP={self.etp} expert-DP={self.expert_dp}"
        if self.vpp:
            text += f" VPP={self.vpp}"
        return text

    def problems(
        self,
        shape: ModelShape,
        uneven_stage_layers: tuple[int | None, int | None] = (None, None),
        pipeline_extra_layers: int = 0,
    ) -> list[str]:
        """Every reason megatron-core would refuse this layout for this model; empty when it is fine.

        ``uneven_stage_layers`` holds ``num_layers_in_{first,last}_pipeline_stage`` when they are set;
        ``pipeline_extra_layers`` counts the embedding and the loss when megatron splits them like layers
        (``account_for_{embedding,loss}_in_pipeline_split``).
        """
        out = []
        for name, size in [
            ("tensor", self.tp),
            ("pipeline", self.pp),
            ("context", self.cp),
            ("expert", self.ep),
            ("expert tensor", self.etp),
        ]:
            if size < 1:
                out.append(f"{name} model parallel size must be >= 1, got {size}")
        if out:
            return out
        if self.world_size % self.model_parallel:
            out.append(
                f"world size {self.world_size} is not divisible by TP*PP*CP = "
                f"{self.tp}*{self.pp}*{self.cp} = {self.model_parallel}"
            )
        out += self._head_problems(shape)
        out += self._pipeline_problems(shape, uneven_stage_layers, pipeline_extra_layers)
        out += self._expert_problems(shape)
        return out

    def _head_problems(self, shape: ModelShape) -> list[str]:
        heads, kv, tp = shape.num_attention_heads, shape.num_kv_heads, self.tp
        out = []
        if heads % tp:
            out.append(f"attention heads ({heads}) are not divisible by TP={tp}: TP must divide {heads}")
        if not tp_splits_kv_heads(kv, tp):
            out.append(
                f"TP={tp} neither divides the {kv} KV heads nor is a multiple of them: TP must be a divisor of "
                f"{kv} or a multiple of {kv} (each KV head then serves TP/{kv} ranks)"
            )
        elif not out and (heads + 2 * kv) * shape.head_dim % tp:
            # megatron splits the fused QKV rows evenly over TP, cutting through query groups when TP > kv
            out.append(
                f"the fused QKV projection's {(heads + 2 * kv) * shape.head_dim} rows "
                f"(({heads} + 2*{kv}) heads x {shape.head_dim}) are not divisible by TP={tp}"
            )
        return out

    def _pipeline_problems(self, shape: ModelShape, uneven: tuple[int | None, int | None], extra: int) -> list[str]:
        first, last = uneven
        if self.vpp is not None and self.pp == 1:
            return ["virtual pipeline stages need pipeline_model_parallel_size > 1"]
        if extra and (first or last):
            return ["account_for_{embedding,loss}_in_pipeline_split cannot be combined with uneven first/last stages"]
        layers, stages = shape.num_layers + extra, self.pp
        for fixed in (first, last):
            if fixed is not None and self.pp > 1:
                layers, stages = layers - fixed, stages - 1
        if stages == 0 or layers < stages:
            return [f"{shape.num_layers} layers cannot fill PP={self.pp} stages with the uneven stage sizes given"]
        chunks = stages * (self.vpp or 1)
        if layers % chunks:
            what = "the layers left after the uneven first/last stages" if (first or last) else "layers"
            what += " (with the embedding/loss counted as layers)" if extra else ""
            return [
                f"{what} ({layers}) are not divisible by PP{'*VPP' if self.vpp else ''}={chunks}; "
                "set +...override_transformer_config.num_layers_in_first_pipeline_stage / "
                "num_layers_in_last_pipeline_stage for uneven stages"
            ]
        return []

    def _expert_problems(self, shape: ModelShape) -> list[str]:
        if not shape.is_moe:
            if self.ep > 1 or self.etp > 1:
                return [f"expert parallelism (EP={self.ep}, ETP={self.etp}) needs an MoE model; this one is dense"]
            return []
        out = []
        if shape.num_experts % self.ep:
            out.append(f"{shape.num_experts} experts are not divisible by EP={self.ep}")
        if self.world_size % (self.etp * self.ep * self.pp):
            out.append(f"world size {self.world_size} is not divisible by ETP*EP*PP = {self.etp}*{self.ep}*{self.pp}")
        return out


# ---- a config's layout ------------------------------------------------------------------------------------


def world_size(cfg: GRPOConfig) -> int:
    return cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node


def actor_layout(cfg: GRPOConfig) -> ParallelLayout:
    m = cfg.actor_rollout_ref.actor.megatron
    ep = m.expert_model_parallel_size
    return ParallelLayout(
        world_size=world_size(cfg),
        tp=m.tensor_model_parallel_size,
        pp=m.pipeline_model_parallel_size,
        cp=m.context_parallel_size,
        ep=ep,
        etp=m.expert_tensor_parallel_size or 1,
        vpp=m.virtual_pipeline_model_parallel_size,
    )


def uneven_stages(overrides: dict) -> tuple[int | None, int | None]:
    return overrides.get("num_layers_in_first_pipeline_stage"), overrides.get("num_layers_in_last_pipeline_stage")


def pipeline_extra_layers(overrides: dict) -> int:
    """The embedding and the loss, when megatron places them in the pipeline split like layers."""
    return sum(bool(overrides.get(f"account_for_{what}_in_pipeline_split")) for what in ("embedding", "loss"))
