"""The numbers of a decoder-only transformer that layout checks and memory estimates need.

Read from a Hugging Face ``config.json``: a local directory, the built-in table of the guide's models
(offline), or the hub, in that order. Covers Llama, Qwen2/2.5 (QKV bias), Qwen3 (QK norm) and
Qwen3-MoE-style models.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from grpo_core.models.known_configs import find_known_config

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral")
MLA = "multi-head latent attention (MLA) models such as DeepSeek-V2/V3, R1, Kimi K2 and Moonlight"
NOT_OFFERED = {"deepseek_v2": MLA, "deepseek_v3": MLA, "kimi_k2": MLA}
"""Architectures people bring from verl that the bridge does not build, by model_type."""
NOT_OFFERED_IDS = ("deepseek-ai/DeepSeek-V2", "deepseek-ai/DeepSeek-V3", "deepseek-ai/DeepSeek-R1", "moonshotai/")
"""Hub ids of such models, refused without reading their config (offline runs cannot read it)."""


class ModelShapeError(Exception):
    """The model's config could not be found or read."""


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tie_embeddings: bool
    max_position_embeddings: int
    qkv_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    experts_per_token: int = 0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    rope_scaling_factor: float | None = None  # Llama-3.1-style ("llama3") RoPE scaling; None: plain RoPE

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def attention_params_per_layer(self) -> int:
        q = self.num_attention_heads * self.head_dim
        kv = 2 * self.num_kv_heads * self.head_dim
        bias = (q + kv) if self.qkv_bias else 0
        norms = 2 * self.head_dim if self.qk_norm else 0
        return self.hidden_size * (q + kv) + q * self.hidden_size + bias + norms + 2 * self.hidden_size

    @property
    def dense_mlp_params_per_layer(self) -> int:
        return 0 if self.is_moe else 3 * self.hidden_size * self.ffn_hidden_size

    @property
    def expert_params_per_layer(self) -> int:
        return self.num_experts * 3 * self.hidden_size * self.moe_ffn_hidden_size

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)

    @property
    def dense_params(self) -> int:
        """Everything outside the experts (router included): split by TP and PP."""
        router = self.num_experts * self.hidden_size
        per_layer = self.attention_params_per_layer + self.dense_mlp_params_per_layer + router
        return self.num_layers * per_layer + self.embedding_params + self.hidden_size

    @property
    def expert_params(self) -> int:
        """Expert weights: split by EP x ETP and PP."""
        return self.num_layers * self.expert_params_per_layer

    @property
    def num_params(self) -> int:
        return self.dense_params + self.expert_params

    @property
    def active_params(self) -> int:
        """Parameters one token passes through (for FLOPs): only its top-k experts."""
        if not self.is_moe:
            return self.num_params
        per_expert = 3 * self.hidden_size * self.moe_ffn_hidden_size
        return self.dense_params + self.num_layers * self.experts_per_token * per_expert

    @classmethod
    def from_hf_config(cls, config: dict) -> "ModelShape":
        model_type = config.get("model_type", "")
        if model_type in NOT_OFFERED:
            raise ModelShapeError(f"model_type {model_type!r}: not offered here: {NOT_OFFERED[model_type]}")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelShapeError(
                f"model_type {model_type!r} is not supported; supported: {list(SUPPORTED_MODEL_TYPES)}"
            )
        try:
            heads = config["num_attention_heads"]
            hidden = config["hidden_size"]
            return cls(
                model_type=model_type,
                hidden_size=hidden,
                num_layers=config["num_hidden_layers"],
                num_attention_heads=heads,
                num_kv_heads=config.get("num_key_value_heads") or heads,
                head_dim=config.get("head_dim") or hidden // heads,
                ffn_hidden_size=config["intermediate_size"],
                vocab_size=config["vocab_size"],
                tie_embeddings=bool(config.get("tie_word_embeddings", False)),
                max_position_embeddings=config.get("max_position_embeddings", 4096),
                qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
                qk_norm=model_type.startswith("qwen3"),
                num_experts=config.get("num_experts") or config.get("num_local_experts") or 0,
                moe_ffn_hidden_size=config.get("moe_intermediate_size", 0) or 0,
                experts_per_token=config.get("num_experts_per_tok", 0) or 0,
                rope_theta=_rope_theta(config),
                norm_eps=float(config.get("rms_norm_eps") or 1e-6),
                rope_scaling_factor=_rope_scaling_factor(config),
            )
        except KeyError as e:
            raise ModelShapeError(f"config.json has no {e.args[0]!r}") from None


def _rope_theta(config: dict) -> float:
    """transformers 5 nests the base in ``rope_parameters`` (older configs: top level or ``rope_scaling``)."""
    for section in (config, config.get("rope_parameters") or {}, config.get("rope_scaling") or {}):
        if section.get("rope_theta") is not None:
            return float(section["rope_theta"])
    return 10000.0


LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
"""The llama3 RoPE scaling megatron-core implements: only ``factor`` is a parameter there."""


def _rope_scaling_factor(config: dict) -> float | None:
    """Llama 3.1/3.2 stretch the low RoPE frequencies ("llama3" scaling); other scalings are refused
    rather than silently ignored, which would give wrong logits."""
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return None
    fixed = {k: float(scaling.get(k, v)) for k, v in LLAMA3_ROPE.items()}
    if kind != "llama3" or fixed != LLAMA3_ROPE:
        raise ModelShapeError(f"RoPE scaling {scaling} is not supported; supported: llama3 with {LLAMA3_ROPE}")
    return float(scaling.get("factor", 8.0))


def _read_local(path: Path) -> dict:
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise ModelShapeError(f"{path}: no config.json there")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelShapeError(f"{config_file}:{e.lineno}: malformed JSON: {e.msg}") from None


def _path_syntax(name_or_path: str) -> bool:
    """Written as a path (``./``, ``/``, ``~``, not exactly one ``/``): never a hub id (org/name)."""
    return name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") != 1


def looks_local(name_or_path: str) -> bool:
    """A path rather than a hub id: path syntax or an existing parent directory (``models/x`` where ``models/``
    exists): a typo there is a missing directory, not a hub question."""
    return _path_syntax(name_or_path) or Path(name_or_path).expanduser().parent.is_dir()


def no_such_directory(name_or_path: str) -> str:
    return f"{name_or_path}: no such local directory ({Path(name_or_path).expanduser().absolute()})"


def _not_on_the_hub(name_or_path: str) -> str:
    """The error for a path that ``looks_local`` and does not exist: the directory first, then why not the hub."""
    if _path_syntax(name_or_path):
        return f"{no_such_directory(name_or_path)}, and not a hub id (org/name)"
    return f"{no_such_directory(name_or_path)}; its parent directory exists, so it is not looked up on the hub"


def _hub_problem(repo_id: str) -> str | None:
    """Why ``repo_id`` cannot be looked up on the hub now, asked once (hf_hub_download retries an unreachable
    endpoint for ~30 s): HF_HUB_OFFLINE is set, or the endpoint does not answer. None: go ahead."""
    from huggingface_hub import constants, get_session

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set and the Hugging Face cache does not hold it"
    try:
        get_session().head(f"{constants.ENDPOINT}/api/models/{repo_id}", timeout=10)
    except Exception as e:  # noqa: BLE001  (any transport error: refused, DNS, TLS, timeout)
        reason = str(e).splitlines()[0][:120] if str(e).strip() else type(e).__name__
        return f"the Hugging Face hub at {constants.ENDPOINT} does not answer ({reason})"
    return None


def _hub_file(repo_id: str, filename: str) -> str | None:
    """``filename`` of ``repo_id`` from the Hugging Face cache, without the network; None when not cached."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, filename)
    return found if isinstance(found, str) else None


def _read_hub(repo_id: str) -> dict:
    from huggingface_hub import hf_hub_download

    if (cached := _hub_file(repo_id, "config.json")) is not None:
        return json.loads(Path(cached).read_text())
    if problem := _hub_problem(repo_id):
        raise ModelShapeError(f"{no_such_directory(repo_id)}, and as a hub id: {problem}")
    try:
        return json.loads(Path(hf_hub_download(repo_id, "config.json")).read_text())
    except Exception as e:  # gated, missing: all end the same way for the user
        reason = str(e).splitlines()[0][:200]
        raise ModelShapeError(
            f"{no_such_directory(repo_id)}, and the Hugging Face hub has no config.json for it ({reason})"
        ) from None


def read_hf_config(name_or_path: str) -> dict:
    """The model's ``config.json``: local directory (or the file itself), then the built-in table, then the hub."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return _read_local(path)
    known = find_known_config(name_or_path)
    if known is not None:
        return dict(known)
    if looks_local(name_or_path):
        raise ModelShapeError(_not_on_the_hub(name_or_path))
    if name_or_path.startswith(NOT_OFFERED_IDS):
        raise ModelShapeError(f"{name_or_path}: not offered here: {MLA}")
    return _read_hub(name_or_path)


def load_model_shape(name_or_path: str, override_config: dict | None = None) -> ModelShape:
    """The shape of ``config.json`` with ``override_config`` (``actor_rollout_ref.model.override_config``) applied."""
    return ModelShape.from_hf_config(with_overrides(read_hf_config(name_or_path), hf_overrides(override_config)))


# ---- actor_rollout_ref.model.override_config ---------------------------------------------------------------

HF_OVERRIDE_SECTION = "model_config"
"""verl's Megatron workers read Hugging Face config fields from ``override_config.model_config``; its other
sections (``moe_config``, ...) steer verl's own code and are refused by the config check."""


def hf_overrides(override_config: dict | None) -> dict:
    """The Hugging Face config fields to override: ``override_config.model_config``. Every reader of the model's
    config (shape, actor, rollout engines, the saved trainer state) goes through this and ``with_overrides``."""
    fields = (override_config or {}).get(HF_OVERRIDE_SECTION)
    return dict(fields) if isinstance(fields, dict) else {}  # anything else is the config check's error


def overridden_fields(config: dict, overrides: dict) -> dict:
    """The top-level fields to set on ``config`` (a dict value, say ``rope_scaling``, replaces the whole field,
    as setting the attribute on a transformers config does). transformers 5 reads the RoPE base from
    ``rope_parameters``: an overridden ``rope_theta`` is written there too, so every reader sees it."""
    fields = dict(overrides)
    rope = config.get("rope_parameters")
    if "rope_theta" in overrides and isinstance(rope, dict) and "rope_parameters" not in overrides:
        fields["rope_parameters"] = {**rope, "rope_theta": overrides["rope_theta"]}
    return fields


def with_overrides(config: dict, overrides: dict) -> dict:
    """``config`` (a config.json as a dict) with ``overrides`` applied."""
    return {**config, **overridden_fields(config, overrides)}


def unknown_override_fields(config: dict, overrides: dict) -> list[str]:
    """Overridden fields that are neither in ``config`` nor attributes transformers' config class for its
    model type knows: likely typos, which transformers would store and nothing would read."""
    new = [key for key in overrides if key not in config]
    if not new:
        return []
    from transformers import AutoConfig, PretrainedConfig

    try:
        known = set(AutoConfig.for_model(config.get("model_type", "")).to_dict())
    except ValueError:  # a model type transformers does not know
        known = set(PretrainedConfig().to_dict())
    return [key for key in new if key not in known]


WEIGHT_FILES = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja")


def model_weights_dir(name_or_path: str) -> Path:
    """A local directory holding the model's config, safetensors and tokenizer: the path itself, or the
    hub snapshot (downloaded once into the Hugging Face cache; later runs read the cache)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not any(path.glob("*.safetensors")):
            raise ModelShapeError(f"{path}: no *.safetensors weights there")
        return path
    if path.exists() or looks_local(name_or_path):
        raise ModelShapeError(_not_on_the_hub(name_or_path))
    from huggingface_hub import snapshot_download

    if problem := _hub_problem(name_or_path) if _hub_file(name_or_path, "config.json") is None else None:
        raise ModelShapeError(f"{no_such_directory(name_or_path)}, and as a hub id: {problem}")
    try:
        return Path(snapshot_download(name_or_path, allow_patterns=list(WEIGHT_FILES)))
    except Exception as e:
        reason = str(e).splitlines()[0][:200]
        raise ModelShapeError(
            f"could not download {name_or_path!r} from the Hugging Face hub ({reason}); "
            "point actor_rollout_ref.model.path at a local directory"
        ) from None
