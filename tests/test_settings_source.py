"""A setting's default has one source, the config schema: the policy losses' and advantage estimators' keywords,
the loss and actor settings classes and LoRA's take theirs from it (``SETTING``, config/defaults.py), and a changed
schema default is what a caller that omits the setting gets."""

import ast
import dataclasses
import inspect
from operator import attrgetter
from pathlib import Path

import pytest
import torch

from grpo_core.algos import ADV_ESTIMATORS, POLICY_LOSSES
from grpo_core.algos.settings import SECTIONS, SETTING, schema_defaults
from grpo_core.config import load_config
from grpo_core.config.defaults import defaults_from, schema_default, section_defaults, setting_default
from grpo_core.config.schema import ActorConfig, PolicyLossConfig

REPO = Path(__file__).resolve().parents[1]

OWN_DEFAULTS = {
    ("gspo", "loss_agg_mode"),  # verl recommends seq-mean-token-mean for GSPO
    ("sapo", "loss_agg_mode"),  # verl always aggregates SAPO so
    ("geo_mean", "loss_agg_mode"),  # a mean of sequence losses, as verl's
    ("dppo_tv", "clip_ratio_c"),  # verl's fallback of 20 (the trainer passes actor.clip_ratio_c)
    ("dppo_kl", "clip_ratio_c"),
}
"""Keywords whose default is the loss's own, not the schema's (and differs from it)."""


def _schema_setting(name: str, sections=SECTIONS) -> tuple[bool, object]:
    """(True, the schema's default) when ``name`` is a setting of ``sections``, else (False, None)."""
    try:
        return True, setting_default(name, sections)
    except KeyError:
        return False, None


def _setting_keywords(fn) -> dict[str, object]:
    """{keyword: its default} of each keyword of ``fn`` named like a setting of SECTIONS."""
    params = inspect.signature(fn).parameters.values()
    return {p.name: p.default for p in params if _schema_setting(p.name)[0]}


REGISTERED = [("loss", n, f) for n, f in POLICY_LOSSES.items()] + [
    ("estimator", n, f) for n, f in ADV_ESTIMATORS.items()
]


@pytest.mark.parametrize(("kind", "name", "fn"), REGISTERED, ids=[f"{k}/{n}" for k, n, _ in REGISTERED])
def test_every_setting_keyword_defaults_to_the_schemas(kind, name, fn):
    keywords = _setting_keywords(fn)
    assert keywords or kind == "estimator", f"{name} takes no setting"
    for keyword, default in keywords.items():
        schema = setting_default(keyword, SECTIONS)
        if (name, keyword) in OWN_DEFAULTS:
            assert default != schema, f"{name}.{keyword}: its own default equals the schema's: use SETTING"
        else:
            assert default is not SETTING and default == schema and type(default) is type(schema), (name, keyword)


def _batch() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    old = torch.rand(3, 5, generator=g, dtype=torch.float64).mul(0.9).add(0.05).log()
    new = (old + 0.3 * torch.randn(3, 5, generator=g, dtype=torch.float64)).clamp(max=-0.01)
    adv = torch.randn(3, 1, generator=g, dtype=torch.float64).expand(3, 5).clone()
    mask = torch.ones(3, 5, dtype=torch.float64)
    mask[1, 3:] = 0
    return old, new, adv, mask


@pytest.mark.parametrize("name", list(POLICY_LOSSES))
def test_a_loss_called_without_its_settings_computes_with_the_schemas(name):
    """verl's call, optional keywords omitted, equals the call given every schema default explicitly."""
    fn = POLICY_LOSSES[name]
    needed = {"dro_beta": 0.1} if name == "dro" else {}  # dro's beta has no default: verl's neither
    explicit = {k: setting_default(k, SECTIONS) for k in _setting_keywords(fn) if (name, k) not in OWN_DEFAULTS}
    runs = []
    for settings in (needed, explicit | needed):
        extra = {"generator": torch.Generator().manual_seed(1)} if name == "clip_cov" else {}
        runs.append(fn(*_batch(), **settings, **extra))
    (loss, metrics), (loss_explicit, metrics_explicit) = runs
    torch.testing.assert_close(loss, loss_explicit, rtol=0, atol=0)
    assert metrics.keys() == metrics_explicit.keys()
    for key, value in metrics.items():
        torch.testing.assert_close(value, metrics_explicit[key], rtol=0, atol=0)


def test_a_changed_schema_default_is_what_an_omitted_setting_gets(monkeypatch):
    """The defaults are read from the schema's fields when a function or class is decorated: patch one, and what
    is decorated after takes the new value (the registries decorate every loss and estimator the same way)."""
    policy_loss = {f.name: f for f in dataclasses.fields(PolicyLossConfig)}
    actor = {f.name: f for f in dataclasses.fields(ActorConfig)}
    monkeypatch.setattr(policy_loss["ppo_kl_coef"], "default", 0.7)
    monkeypatch.setattr(actor["loss_agg_mode"], "default", "seq-mean-token-sum")

    @schema_defaults
    def loss(log_prob, ppo_kl_coef: float = SETTING, loss_agg_mode: str = SETTING, denominator=None):
        return ppo_kl_coef, loss_agg_mode, denominator

    @dataclasses.dataclass(frozen=True)
    @schema_defaults
    class Settings:
        ppo_kl_coef: float = SETTING

    assert loss(None) == (0.7, "seq-mean-token-sum", None)
    assert inspect.signature(loss).parameters["ppo_kl_coef"].default == 0.7
    assert Settings().ppo_kl_coef == 0.7
    assert section_defaults("actor_rollout_ref.actor.policy_loss")["ppo_kl_coef"] == 0.7
    with pytest.raises(KeyError, match="no_such_setting"):
        defaults_from(*SECTIONS)(lambda no_such_setting=SETTING: None)


def test_the_settings_classes_default_to_the_schema():
    from grpo_core.actor.loss import LossSettings
    from grpo_core.actor.settings import SECTIONS as ACTOR_SECTIONS
    from grpo_core.actor.settings import ActorSettings
    from grpo_core.models.lora_settings import LORA, LoRASettings
    from grpo_core.planning.layout import ParallelLayout

    loss = dataclasses.asdict(LossSettings())
    assert loss == {name: setting_default(name, SECTIONS) for name in loss}

    actor = ActorSettings(layout=ParallelLayout(world_size=1))
    own = {"dtype": "float32", "sequence_parallel": False, "lr_warmup_steps": 0}  # the actor's own (docstring)
    for name, value in dataclasses.asdict(actor).items():
        is_setting, schema = _schema_setting(name, ACTOR_SECTIONS)
        if is_setting:
            assert value == own.get(name, schema), name
    assert actor.micro_batch_rows == schema_default("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu")
    assert actor.reshardable_checkpoint == schema_default(
        "actor_rollout_ref.actor.megatron.dist_ckpt_optim_fully_reshardable"
    )
    assert actor.recompute == schema_default("actor_rollout_ref.model.enable_gradient_checkpointing")
    assert actor.loss == LossSettings()

    lora = LoRASettings()
    defaults = section_defaults(LORA)
    assert (lora.rank, lora.alpha, lora.dropout) == (defaults["rank"], defaults["alpha"], defaults["dropout"])
    assert lora.target_modules == tuple(defaults["target_modules"])
    assert lora.exclude_modules == tuple(defaults["exclude_modules"])
    assert (lora.a_init, lora.b_init) == (defaults["lora_A_init_method"], defaults["lora_B_init_method"])


def test_loss_settings_take_every_setting_of_their_name_from_the_config():
    from grpo_core.actor.loss import LossSettings

    cfg = load_config(
        None,
        [
            "actor_rollout_ref.actor.clip_ratio_high=0.28",
            "actor_rollout_ref.actor.tau_neg=2.0",
            "actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov",
            "actor_rollout_ref.actor.policy_loss.kl_cov_ratio=0.01",
            "algorithm.rollout_correction.rollout_is=token",
            "algorithm.rollout_correction.loss_type=reinforce",
        ],
    )
    settings = LossSettings.from_config(cfg)
    for name, value in dataclasses.asdict(settings).items():
        section = next(s for s in SECTIONS if name in section_defaults(s))
        expected = attrgetter(f"{section}.{name}")(cfg)
        if name == "loss_scale_factor":  # null: data.max_response_length (Dr.GRPO's constant)
            expected = float(cfg.data.max_response_length)
        assert value == expected, name
    assert (settings.clip_ratio_high, settings.kl_cov_ratio, settings.loss_type) == (0.28, 0.01, "reinforce")


def _restated_defaults(path: Path) -> list[str]:
    """Function keywords of ``path`` whose literal default is the schema's default of the setting of that name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.FunctionDef):
            continue
        args = node.args.posonlyargs + node.args.args
        for arg, default in zip(args[len(args) - len(node.args.defaults) :], node.args.defaults, strict=True):
            is_setting, schema = _schema_setting(arg.arg)
            value = default.value if isinstance(default, ast.Constant) else SETTING
            if is_setting and value == schema and type(value) is type(schema):
                found.append(f"{path.name}: {node.name}({arg.arg}={value!r})")
    return found


def test_no_algorithm_restates_a_schema_default():
    restated = [line for path in sorted((REPO / "grpo_core/algos").glob("*.py")) for line in _restated_defaults(path)]
    # agg_loss's loss_scale_factor is its own knob (None: the mask's width), not the setting (null: max length)
    assert restated == ["policy_loss.py: agg_loss(loss_scale_factor=None)"]
