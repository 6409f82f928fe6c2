"""verl's own command lines and keys: every key is a setting, an alias, a no-effect note or a named refusal.

The 13 Megatron GRPO scripts of verl's examples/grpo_trainer (their expanded command lines are in
../shared/data/verl) run through `grpo train --dry-run` with only the entry point swapped."""

import json
import shlex

import pytest
import torch

from grpo_core.algos import overlong_penalty
from grpo_core.cli import main
from grpo_core.config import ConfigError, load_config
from grpo_core.config.load import load_config_with_notes
from grpo_core.config.verl_keys import IGNORED_AND_REFUSED, find
from tests.conftest import REPO

BASE = str(REPO / "configs" / "grpo_base.yaml")

LOCAL_MODELS = {
    "<path_to_dsv3_config>": "deepseek-ai/DeepSeek-V3",
    "/home/user/verl/models/DeepSeek-V3-config-verl": "deepseek-ai/DeepSeek-V3",
    "/home/user/verl/models/Qwen3-235B-A22B": "Qwen/Qwen3-235B-A22B",
}
"""The scripts' local model directories, as the hub ids a user would give here."""

MLA = "not offered here: multi-head latent attention"
EXPECTED = {
    "run_deepseek671b_math_megatron_80gb": MLA,
    "run_deepseek671b_math_megatron_96gb": MLA,
    "run_deepseek7b_llm_math_megatron": "ok",
    "run_moonlight16b_math_megatron": MLA,
    "run_qwen2-7b_math_megatron": "ok",
    "run_qwen2-7b_math_megatron_lora": "ok",
    "run_qwen2-7b_math_megatron_trtllm": "not offered here: the TensorRT-LLM rollout engine",
    "run_qwen2-7b_seq_balance_math_megatron": "ok",
    "run_qwen2-7b_sgl_megatron": "not offered here: the SGLang rollout engine",
    "run_qwen2_5-7b_math_megatron_diff_tp": "ok",
    "run_qwen3-235b_megatron_96gb": "ok",
    # its validation file is a variable the script leaves empty (data.val_files=['']): every rank failed to read ''
    "run_qwen3moe-30b_megatron_96gb": "data.val_files=['']: an empty file name",
    # LoRA with CP=2 (all-gathered keys and values, models/context_parallel.py) and token budgets with PP=2 on
    # unpacked rows (a fixed number of whole rows per micro-batch)
    "run_qwen3moe-30b_megatron_lora": "ok",
}


def verl_command_lines(shared: "pathlib.Path") -> dict[str, list[str]]:  # noqa: F821
    scripts = json.loads((shared / "data" / "verl" / "grpo_trainer_megatron_args.json").read_text())
    lines = {}
    for name, args in scripts.items():
        key_values = [a.split("=", 1) for a in args]
        args = [f"{k}={LOCAL_MODELS.get(v, v) if k.endswith('model.path') else v}" for k, v in key_values]
        lines[name] = args + (["trainer.gpu_memory_gib=96"] if name.endswith("_96gb") else [])
    return lines


@pytest.fixture(scope="module")
def verl_scripts(request) -> dict[str, list[str]]:
    from tests.conftest import SHARED

    if not SHARED.is_dir():
        pytest.skip(f"{SHARED} (the shared test material) is not present")
    return verl_command_lines(SHARED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_verl_scripts_dry_run_with_only_the_entry_point_swapped(name, verl_scripts, capsys):
    code = main(["train", *verl_scripts[name], "--dry-run"])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "unknown key" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    if EXPECTED[name] == "ok":
        assert code == 0, err
        assert "parallel layout:" in out and "phase: update" in out and "dry run OK" in out
    elif not EXPECTED[name].startswith("not offered here"):  # a limit of this project's, not a verl feature
        assert code == 2 and any(EXPECTED[name] in line for line in errors), err
    else:
        assert code == 2
        assert errors and all("not offered here" in line for line in errors), err
        assert any(EXPECTED[name] in line for line in errors), err
    assert set(EXPECTED) == set(verl_scripts)


def test_verl_keys_of_no_effect_are_notes(capsys):
    overrides = [
        "trainer.critic_warmup=0",
        "actor_rollout_ref.actor.megatron.use_mbridge=True",
        "+actor_rollout_ref.ref.fsdp_config.param_offload=True",
        "actor_rollout_ref.model.lora.merge=False",  # verl's adapter-only sync: the engines get merged weights
        "actor_rollout_ref.rollout.mode=async",
        "data.return_raw_chat=True",
    ]
    cfg, notes = load_config_with_notes(None, overrides)
    assert cfg.actor_rollout_ref.rollout.mode == "async"
    assert notes == [
        "trainer.critic_warmup: no effect here: GRPO has no critic (value model); critic settings have no effect",
        "actor_rollout_ref.actor.megatron.use_mbridge: no effect here: the project's own Hugging Face <-> "
        "megatron-core bridge always converts the model",
        "actor_rollout_ref.ref.fsdp_config.param_offload: no effect here: FSDP settings, which verl too ignores "
        "under its Megatron strategy",
        "actor_rollout_ref.model.lora.merge: no effect here: the rollout engines always get the merged weights "
        "W + alpha/rank B A after each update",
        "data.return_raw_chat: no effect here: prompts are kept as chat messages and templated by the tokenizer; "
        "raw chats are always available",
    ]
    assert main(["train", "--config", BASE, *overrides, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("note: ") == 6  # the five above and rollout.mode=async's
    assert "note: actor_rollout_ref.rollout.mode=async: the engine is colocated" in out


def test_checkpoint_contents_as_verl_scripts_write_them(capsys):
    ckpt = "actor_rollout_ref.actor.checkpoint"
    verl_style = [f"{ckpt}.save_contents=['model','optimizer','extra','hf_model']", f"{ckpt}.async_save=False"]
    assert main(["train", "--config", BASE, *verl_style, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "note: actor_rollout_ref.actor.checkpoint.save_contents" not in out  # hf_model is written, as in verl
    assert f"note: {ckpt}.async_save: no effect here: checkpoints are written synchronously" in out
    assert main(["train", "--config", BASE, f"{ckpt}.save_contents=[hf_model]", "--dry-run"]) == 0
    assert "has no 'model': the model is saved anyway" in capsys.readouterr().out
    assert main(["train", "--config", BASE, f"{ckpt}.load_contents=[model,weights]", "--dry-run"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: {ckpt}.load_contents entry 'weights' is not valid; valid: ['model', 'optimizer', 'extra', 'hf_model']"
    ], errors


@pytest.mark.parametrize(
    "override,feature",
    [
        ("actor_rollout_ref.model.lora.type=dora", "LoRA types other than plain lora"),
        ("actor_rollout_ref.rollout.multi_turn.enable=True", "single-turn generation only"),
        ("critic.enable=True", "a critic (value model)"),
        ("actor_rollout_ref.rollout.name=sglang", "the SGLang rollout engine"),
        ("algorithm.adv_estimator=gae", "GAE, which needs a critic"),
        ("algorithm.gdpo_reward_keys=[format,acc]", "per-component rewards for gdpo"),
        ("algorithm.kl_ctrl.type=adaptive", "the adaptive in-reward KL controller"),
        ("actor_rollout_ref.actor.ppo_micro_batch_size=64", "deprecated global micro-batch size"),
        ("actor_rollout_ref.model.path=deepseek-ai/DeepSeek-V3", "multi-head latent attention"),
    ],
)
def test_features_not_offered_are_refused_by_name(override, feature, capsys):
    assert main(["train", "--config", BASE, override, "--dry-run"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "not offered here" in errors[0] and feature in errors[0], errors


def test_typos_of_verl_keys_still_get_did_you_mean():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["trainer.critic_warmpu=0"])
    assert e.value.problems == [
        "override 'trainer.critic_warmpu=…': unknown key 'trainer.critic_warmpu'; did you mean 'trainer.critic_warmup'?"
    ]


def test_every_table_entry_is_reachable_and_classified():
    for entry in IGNORED_AND_REFUSED:
        probe = entry.pattern.replace("*", "x")
        assert find(probe) is not None, entry.pattern
        assert entry.reason, entry.pattern


def test_the_guides_spellings_and_verls_other_names():
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.actor.optimizer.lr=2e-6",
            "actor_rollout_ref.actor.optimizer.weight_decay=0.1",
            "actor_rollout_ref.actor.optim.clip_grad=0.5",
            "actor_rollout_ref.actor.optim.betas=[0.9,0.95]",
            "actor_rollout_ref.actor.optim.total_training_steps=-1",
        ],
    )
    optim = cfg.actor_rollout_ref.actor.optim
    assert (optim.lr, optim.weight_decay, optim.adam_beta1, optim.adam_beta2) == (2e-6, 0.1, 0.9, 0.95)
    assert cfg.actor_rollout_ref.actor.grad_clip == 0.5
    assert optim.total_training_steps is None  # verl's -1: from the run's length
    with pytest.raises(ConfigError) as e:
        load_config(None, ["actor_rollout_ref.actor.optimizer.lr=2e-6", "actor_rollout_ref.actor.optim.lr=1e-6"])
    assert "conflicts with actor_rollout_ref.actor.optim.lr=1e-06" in e.value.problems[0]


def test_verls_sentinel_values():
    cfg = load_config(None, ["trainer.default_local_dir=", "trainer.project_name=p", "trainer.experiment_name=e"])
    assert cfg.trainer.default_local_dir == "checkpoints/p/e"  # verl's default directory
    cfg = load_config(None, ["trainer.resume_mode=resume_path", "trainer.resume_from_path=/ckpt/step_000010"])
    assert cfg.trainer.resume_mode == "/ckpt/step_000010"
    with pytest.raises(ConfigError, match="needs trainer.resume_from_path"):
        load_config(None, ["trainer.resume_mode=resume_path"])


def test_hydra_config_path_and_name(tmp_path, capsys):
    # verl's own trainer config names mean this project's defaults
    fits = ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4"]
    assert main(["train", "--config-path=config", "--config-name=ppo_megatron_trainer.yaml", *fits, "--dry-run"]) == 0
    assert "tensor_model_parallel_size: 4" in capsys.readouterr().out
    (tmp_path / "mine.yaml").write_text("trainer:\n  n_gpus_per_node: 4\n  gpu_memory_gib: 141\n")
    assert main(["train", f"--config-path={tmp_path}", "--config-name=mine", *fits, "--dry-run"]) == 0
    assert "n_gpus_per_node: 4" in capsys.readouterr().out
    assert main(["train", f"--config-path={tmp_path}", "--config-name=nope", "--dry-run"]) == 2
    assert f"--config-name nope: no config file {tmp_path}/nope.yaml" in capsys.readouterr().err


def test_grpo_keys_shows_each_class(capsys):
    assert main(["keys", "actor_rollout_ref.model"]) == 0
    out = capsys.readouterr().out
    assert "actor_rollout_ref.model.path (str) = 'Qwen/Qwen2-7B-Instruct': Hugging Face model id" in out
    assert "actor_rollout_ref.model.use_fused_kernels [no effect]: log-probs and entropy" in out
    assert "actor_rollout_ref.model.lora.rank (int) = 0: LoRA rank: > 0 trains low-rank adapters" in out
    assert "actor_rollout_ref.model.lora_rank [alias]: another spelling of actor_rollout_ref.model.lora.rank" in out
    assert "actor_rollout_ref.model.lora.type [not offered]: LoRA types other than plain lora" in out
    assert main(["keys", "actor_rollout_ref.actor.optim"]) == 0
    out = capsys.readouterr().out
    assert (
        "actor_rollout_ref.actor.optim.clip_grad [alias]: another spelling of actor_rollout_ref.actor.grad_clip" in out
    )
    assert (
        "actor_rollout_ref.actor.optim.betas [alias]: another spelling of actor_rollout_ref.actor.optim.adam_beta1 and"
        in out
    )


def test_overlong_penalty_hand_worked():
    # max_resp_len 100, buffer 20: free up to 80 tokens, then -1/20 per token beyond, -1 at 100 (factor 1)
    lengths = torch.tensor([50, 80, 81, 90, 100])
    expected = torch.tensor([0.0, 0.0, -0.05, -0.5, -1.0], dtype=torch.float64)
    assert torch.allclose(overlong_penalty(lengths, 100, 20, 1.0), expected)
    assert torch.allclose(overlong_penalty(lengths, 100, 20, 0.5), expected / 2)


def test_dapo_reward_manager_keys_from_verl_scripts(capsys):
    overrides = shlex.split(
        "reward_model.reward_manager=dapo +reward_model.reward_kwargs.overlong_buffer_cfg.enable=True "
        "+reward_model.reward_kwargs.overlong_buffer_cfg.len=256 "
        "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0 "
        "+reward_model.reward_kwargs.overlong_buffer_cfg.log=False +reward_model.reward_kwargs.max_resp_len=1024"
    )
    cfg = load_config(None, overrides)
    assert cfg.reward_model.reward_kwargs.overlong_buffer_cfg.len == 256
    assert main(["train", *overrides[:2], "--dry-run"]) == 2
    assert "overlong_buffer_cfg.enable=true needs reward_model.reward_kwargs.max_resp_len" in capsys.readouterr().err


def test_a_verl_style_yaml_with_its_sentinels(tmp_path):
    """verl's own YAML leaves rollout.name as ``???``, micro-batch sizes and data.seed as null, and composes
    keys that only mean something to its FSDP workers: each loads, or is one line naming the key."""
    verl = tmp_path / "ppo_megatron_trainer.yaml"
    verl.write_text(
        "actor_rollout_ref:\n"
        "  actor:\n    ppo_micro_batch_size_per_gpu: null\n    use_remove_padding: false\n"
        "    optim: {warmup_style: constant, min_lr_ratio: 0.0, betas: [0.9, 0.999], clip_grad: 1.0}\n"
        "  ref: {entropy_checkpointing: false, fsdp_config: {param_offload: false}}\n"
        "  rollout:\n    name: ???\n    layered_summon: false\n"
        "data: {seed: null}\ntrainer: {val_only: false, use_legacy_worker_impl: auto}\n"
    )
    with pytest.raises(ConfigError) as e:
        load_config(verl)
    assert e.value.problems == ["actor_rollout_ref.rollout.name: no value given (the config says ???); set it"]
    with pytest.raises(ConfigError, match="ppo_micro_batch_size_per_gpu=null: set it, or use_dynamic_bsz=true"):
        load_config(verl, ["actor_rollout_ref.rollout.name=vllm"])
    cfg, notes = load_config_with_notes(
        verl, ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.actor.use_dynamic_bsz=true"]
    )
    assert cfg.data.seed == 1 and cfg.actor_rollout_ref.actor.optim.adam_beta2 == 0.999
    assert len(notes) == 8 and all(": no effect here" in n for n in notes), notes


def test_lora_keys_and_their_verl_spellings(capsys):
    """verl's megatron lora.* keys are settings, its FSDP spellings aliases; rank 0 is off; what is not built is
    refused by name, a bad value is one line."""
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.model.lora_rank=16",
            "actor_rollout_ref.model.lora_alpha=8",
            "actor_rollout_ref.model.target_modules=all-linear",
            "actor_rollout_ref.model.exclude_modules=[linear_fc2]",
            "actor_rollout_ref.model.lora.lora_A_init_method=kaiming",
            "actor_rollout_ref.model.lora.dropout=0.05",
        ],
    )
    lora = cfg.actor_rollout_ref.model.lora
    assert (lora.rank, lora.alpha, lora.target_modules, lora.exclude_modules) == (
        16,
        8.0,
        ["all-linear"],
        ["linear_fc2"],
    )
    assert (lora.lora_A_init_method, lora.lora_B_init_method, lora.dropout) == ("kaiming", "zero", 0.05)
    assert load_config(None, []).actor_rollout_ref.model.lora.rank == 0  # off unless asked for
    with pytest.raises(ConfigError) as e:
        load_config(None, ["actor_rollout_ref.model.lora.canonical=True"])
    assert len(e.value.problems) == 1
    assert "lora.canonical=True: not offered here: this LoRA setting (rank, alpha," in e.value.problems[0]
    for bad, says in [
        ("actor_rollout_ref.model.lora.target_modules=[q_proj]", "entry 'q_proj' is not a LoRA target"),
        ("actor_rollout_ref.model.lora.lora_B_init_method=orthogonal", "lora_B_init_method"),
        ("actor_rollout_ref.model.lora.alpha=0", "lora.alpha=0.0 must be > 0"),
    ]:
        assert main(["train", "--config", BASE, "actor_rollout_ref.model.lora.rank=8", bad, "--dry-run"]) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and says in errors[0], errors
    assert main(["train", "--config", BASE, "actor_rollout_ref.model.lora.rank=8", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "frozen base + LoRA rank 8" in out and "the actor's base, adapters off" in out


RECIPES = json.loads((REPO / "tests" / "verl_recipe_lines.json").read_text())
"""verl's command lines for its other critic-free algorithms (issue 43): its Megatron example scripts of GSPO and DPPO
(examples/{gspo,dppo}_trainer/run_qwen3_30b_a3b_megatron.sh) expanded as verl runs them, and on the GSPO line the
algorithm keys of its other examples (GPG's Megatron script, whose Qwen3-8B is not in the offline model table; the
FSDP-only CISPO, GMPO, GDPO, ReMax and rollout-correction ones) and of its other losses and estimators. And its own
recipe/ scripts under the Megatron strategy (issue 39 item 5: recipe/dapo's and recipe/gspo's, "recipe_*"), with the
DAPO recipe's own spellings (reward_model.overlong_buffer.*, data.gen_batch_size); "from" says which."""


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_verl_recipe_lines_of_the_grpo_family_dry_run(name, capsys):
    code = main(["train", *RECIPES[name]["args"], "--dry-run"])
    out, err = capsys.readouterr()
    assert code == 0 and "dry run OK" in out, err
    assert "Traceback" not in out + err


def test_the_recipes_cover_every_loss_and_estimator():
    from grpo_core.algos import ADV_ESTIMATORS, POLICY_LOSSES

    values = {a for recipe in RECIPES.values() for a in recipe["args"]}
    losses = {v.split("=", 1)[1] for v in values if v.startswith("actor_rollout_ref.actor.policy_loss.loss_mode=")}
    estimators = {v.split("=", 1)[1] for v in values if v.startswith("algorithm.adv_estimator=")}
    assert losses | {"bypass_mode"} == set(POLICY_LOSSES)  # bypass_mode: by rollout_correction.bypass_mode=true
    assert "algorithm.rollout_correction.bypass_mode=true" in values
    assert estimators | {"reinforce_plus_plus"} == set(ADV_ESTIMATORS)
