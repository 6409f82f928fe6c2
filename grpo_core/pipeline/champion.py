"""The registry's champion, for a pipeline run: read, evaluated on the trained model's questions and settings (once
per version and evaluation set), or on a registered model's first run the base model registered as the first
champion; and the trained model's promotion against it (promotion.py decides)."""

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from grpo_core.config.schema import GRPOConfig
from grpo_core.evaluation.gsm8k import compare_evaluations, read_eval_set
from grpo_core.pipeline.evaluations import Evaluations, eval_dir
from grpo_core.pipeline.promotion import BASE_MODEL, BASE_TAG, CHALLENGER, Promotion, decide, eval_set_tags, judge_note
from grpo_core.pipeline.register import register_base_model, registered_name
from grpo_core.pipeline.report import Where, one_line
from grpo_core.tracking.mlflow_run import quick_http, tracking_uri
from grpo_core.tracking.registry import RegistryModel, RegistryUnreachable, champion_uri, fetch_model, full_model

Log = logging.Logger | logging.LoggerAdapter  # the flow run's logger: its lines are the flow run's log


def current_champion(cfg: GRPOConfig) -> str | None:
    """``models:/NAME@champion`` of ``tracking.registered_model_name`` when that alias exists, else None."""
    from mlflow import MlflowClient

    quick_http()
    server = tracking_uri(cfg)
    return champion_uri(MlflowClient(server, registry_uri=server), server, registered_name(cfg))


def champion_model(cfg: GRPOConfig) -> RegistryModel | None:
    """The registry's current champion, fetched; None while there is none."""
    uri = current_champion(cfg)
    return fetch_model(uri, tracking_uri(cfg), cfg.tracking.model_cache_dir) if uri else None


@dataclass
class Champion:
    """What the new version is compared with: the registry's champion (evaluated on the same questions), the base
    model registered as the first one, or none (``known`` False: the registry was unreachable, never promote blind)."""

    version: str | None = None
    tags: dict | None = None
    known: bool = True


def judge_with_champion(
    cfg: GRPOConfig, where: Where, base: dict, evals: Evaluations, evaluate: Callable[[str, Path], dict], log: Log
) -> Champion:
    """The registry's champion, evaluated by ``evaluate(model files, directory)`` on the trained model's questions
    and settings (once per version and evaluation set: ``evals.dirs["champion"]``); on the first run of a registered
    model, the base model registered as version 1 and the champion, its evaluation the base one."""
    if not cfg.tracking.log_model:
        return Champion()
    where.phase = "reading the registry's champion"
    try:
        champion = champion_model(cfg)
    except RegistryUnreachable as e:  # an outage: train and evaluate anyway, never promote blind
        log.warning("%s: cannot compare with the champion; the new version will not be promoted", e)
        return Champion(known=False)
    if champion is None:  # the first run of this registered model
        return base_as_champion(cfg, where, base, evals.dirs, log)
    if judged := read_eval_set(evals.dirs["trained"]):
        note = judge_note(champion.tags, eval_set_tags(judged), f"champion version {champion.version}")
        log.info(note or f"the evaluation set is the one champion version {champion.version} was judged on")
    evals.dirs["champion"] = eval_dir(champion, evals.data_digest, evals.settings)
    where.phase = f"evaluate champion (version {champion.version})"
    files = full_model(champion, tracking_uri(cfg), cfg.tracking.model_cache_dir)  # an adapter: merged into its base
    evaluate(str(files), evals.dirs["champion"])
    return Champion(champion.version, champion.tags)


def base_as_champion(cfg: GRPOConfig, where: Where, base: dict, eval_dirs: dict[str, Path], log: Log) -> Champion:
    """The base model registered as the first version and the champion, its evaluation (``base``) the champion's;
    none when that fails or versions exist already (the trained model is then compared with the base)."""
    where.phase = "registering the base model"
    try:
        registered = register_base_model(cfg, base, eval_dirs["base"])
    except Exception as e:  # noqa: BLE001  (the trained model is still compared with the base, as before)
        log.warning("the base model was not registered as the champion: %s", one_line(e))
        registered = None
    if registered is None:  # versions exist, none is the champion: the trained model is compared with the base
        return Champion()
    version, tags = registered
    eval_dirs["champion"] = eval_dirs["base"]  # evaluated already, on the same questions
    log.info("registered the base model as version %s, the champion to beat", version)
    return Champion(version, tags)


def promotion_of(
    cfg: GRPOConfig, eval_dirs: dict[str, Path], champion_version: str | None, champion_tags: dict[str, str]
) -> Promotion:
    """The trained model against the champion's evaluation (the base model's while there is no champion), on the
    same questions (compare_evaluations refuses others); the reason says when they are not those the champion was
    judged on (its tags ``champion_tags``)."""
    if champion_version is not None:
        against, opponent = f"champion version {champion_version}", eval_dirs["champion"]
        if BASE_TAG in champion_tags:
            against += " (the base model)"
    else:
        against, opponent = BASE_MODEL, eval_dirs["base"]
    comparison = compare_evaluations(opponent, eval_dirs["trained"], cfg.evaluation.metric)
    t = cfg.tracking
    promotion = decide(comparison, against, t.champion_min_uplift, t.champion_alpha)
    judged = read_eval_set(eval_dirs["trained"])
    if champion_version is not None and judged and (note := judge_note(champion_tags, eval_set_tags(judged), against)):
        promotion = replace(promotion, reason=f"{note}: {promotion.reason}")
    return promotion


def promotion_against(cfg: GRPOConfig, eval_dirs: dict[str, Path], champion: Champion) -> Promotion:
    """``promotion_of`` against ``champion``; a challenger whatever the numbers when the registry could not be read."""
    promotion = promotion_of(cfg, eval_dirs, champion.version, champion.tags or {})
    if not champion.known:
        reason = f"{promotion.reason}; the registry's champion could not be read, so nothing is promoted"
        promotion = replace(promotion, alias=CHALLENGER, reason=reason)
    return promotion
