"""MegatronEngine (megatron-core's static inference over the actor's own GPTModel) against HFEngine.

The actor must not be imported in the pytest process (cpu_compat patches torch process-wide), so this
file is also its own torchrun worker, launched once with two processes: ``main()`` builds the tiny fp32
Llama of tests/dist/sync_worker.py (peaked, with prompt 0's first greedy token as an extra stop id) and
an HFEngine from its directory; then, at TP=2 and again at TP=1 (two data-parallel replicas), a fresh
trainable actor, with which it generates, does one GRPO update, pushes the weights into the HFEngine
only (the megatron engine shares the actor's) and generates again. It also runs the trainer's
``generate`` (each replica its share, one copy per TP group gathered). Rank 0 writes every rank's
records as JSON; the tests read them.
"""

import argparse
import json
from pathlib import Path

import pytest

from tests.dist.launch import torchrun
from tests.support.tiny import TOKENIZER

TOL = 1e-4  # fp32; measured ~1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    """One torchrun launch for both layouts: {"tp2": every rank's record, "tp1": ...}."""
    if not TOKENIZER.is_dir():
        pytest.skip(f"{TOKENIZER} (the shared SmolLM2 tokenizer) is not present")
    workdir = tmp_path_factory.mktemp("megatron_rollout")
    out = workdir / "records.json"
    torchrun("../test_rollout_megatron.py", 2, "--workdir", str(workdir), "--out", str(out))
    runs = json.loads(out.read_text())
    for name, ranks in runs.items():
        print(f"{name}:", json.dumps([r["numbers"] for r in ranks]))  # for -s and failure reports
    return runs


@pytest.fixture(params=["tp1", "tp2"])
def records(request, runs) -> list[dict]:
    return runs[request.param]


def test_greedy_matches_hf_tokens_log_probs_and_stops(records):
    for rank in records:
        mine, hf = rank["greedy"], rank["hf_greedy"]
        assert mine["response_ids"] == hf["response_ids"]
        assert mine["finish_reasons"] == hf["finish_reasons"]
        assert "stop" in mine["finish_reasons"] and "length" in mine["finish_reasons"]
        assert mine["group_index"] == hf["group_index"]
        assert rank["numbers"]["greedy_logprob_diff"] <= TOL


def test_sampled_log_probs_are_the_actors_and_seeded_runs_repeat(records):
    for rank in records:
        assert rank["numbers"]["sampled_vs_actor_logprob_diff"] <= TOL
        assert rank["sampled_repeat_equal"]
        assert rank["sampled_distinct"] > 1  # sampling, not greedy
    assert all(r["sampled"] == records[0]["sampled"] for r in records)  # TP ranks sample the same tokens


def test_the_trainers_generate_gathers_each_replicas_rows_once(records):
    """rollouts.generate: every TP rank runs the engine, only TP-rank 0 of each replica contributes rows."""
    for rank in records:
        assert rank["trainer_greedy"]["response_ids"] == rank["greedy"]["response_ids"]
        assert rank["trainer_greedy"]["group_index"] == rank["greedy"]["group_index"]


def test_generates_from_the_updated_actor_without_sync(records):
    for rank in records:
        assert rank["numbers"]["grad_norm"] > 0
        assert rank["numbers"]["moved_by_update"] > 1e-3, "the engine did not see the update"
        assert rank["after_update"]["response_ids"] == rank["hf_after_update"]["response_ids"]
        assert rank["numbers"]["after_update_logprob_diff"] <= TOL


# ---- the torchrun worker -------------------------------------------------------------------------


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def _moved(before: dict, after: dict) -> float:
    """How far the greedy log-probs moved (infinite when the greedy tokens changed)."""
    if before["response_ids"] != after["response_ids"]:
        return float("inf")
    return _max_diff(before["response_log_probs"], after["response_log_probs"])


def _as_dict(gen) -> dict:
    keys = ("response_ids", "response_log_probs", "finish_reasons", "group_index")
    return {key: getattr(gen, key) for key in keys}


def _check_layout(tp: int, hf, prompts: list[list[int]], hf_dir: Path) -> dict:
    """This rank's record at TP=tp: a fresh actor from ``hf_dir``, its engine, the HF engine after the push."""
    import torch.distributed as dist

    from grpo_core.actor.actor import ActorSettings, MegatronActor
    from grpo_core.actor.loss import LossSettings
    from grpo_core.actor.parallel import init_model_parallel
    from grpo_core.config import load_config
    from grpo_core.data.prompts import Prompt
    from grpo_core.models.shape import load_model_shape
    from grpo_core.planning.layout import ParallelLayout
    from grpo_core.rewards import build_scorer
    from grpo_core.rollout import SamplingSettings, to_rollout_batch
    from grpo_core.rollout.megatron import MegatronEngine
    from grpo_core.trainer.rollouts import generate
    from tests.dist.actor_worker import synthetic_batch
    from tests.dist.sync_worker import push

    shape = load_model_shape(str(hf_dir))
    layout = ParallelLayout(world_size=dist.get_world_size(), tp=tp, pp=1)
    init_model_parallel(layout, seed=7)
    settings = ActorSettings(
        layout=layout, lr=1e-3, mini_batch_rows=8, micro_batch_rows=4, loss=LossSettings(use_kl_loss=False)
    )
    actor = MegatronActor(shape, settings, hf_path=str(hf_dir))
    engine = MegatronEngine.from_actor(actor, hf.eos_ids, max_sequence_length=64, max_batch_size=4)

    greedy = SamplingSettings(greedy=True, n=2, max_new_tokens=8)
    sampled = SamplingSettings(n=4, temperature=0.8, top_k=20, max_new_tokens=6, seed=5)  # 12 rows: DP=2 splits them
    record: dict = {"greedy": _as_dict(engine.generate(prompts, greedy))}
    cfg = load_config(None, [f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}"])
    rows = [Prompt(ids, "synthetic/capitals", "", i) for i, ids in enumerate(prompts)]
    record["trainer_greedy"] = _as_dict(generate(engine, rows, greedy, hf.tokenizer, cfg, build_scorer(cfg)).gen)
    gen = engine.generate(prompts, sampled)
    record["sampled"] = gen.response_ids
    record["sampled_repeat_equal"] = engine.generate(prompts, sampled).response_ids == gen.response_ids
    record["sampled_distinct"] = len({tuple(r) for r in gen.response_ids})
    actor_lp, _ = actor.compute_log_prob(to_rollout_batch(gen, pad_id=hf.pad_id), micro_batch_rows=3)
    actor_rows = [row[: len(r)].tolist() for row, r in zip(actor_lp, gen.response_ids, strict=True)]

    batch = synthetic_batch(shape.vocab_size)
    batch.old_log_probs = actor.compute_log_prob(batch)[0]
    metrics = actor.update(batch)
    record["after_update"] = _as_dict(engine.generate(prompts, greedy))
    engine.sleep()
    push(actor, shape, hf)
    record["hf_after_update"] = _as_dict(hf.generate(prompts, greedy))
    record["numbers"] = {
        "sampled_vs_actor_logprob_diff": _max_diff(gen.response_log_probs, actor_rows),
        "after_update_logprob_diff": _max_diff(
            record["after_update"]["response_log_probs"], record["hf_after_update"]["response_log_probs"]
        ),
        "grad_norm": metrics["actor/grad_norm"],
        "moved_by_update": _moved(record["greedy"], record["after_update"]),
    }
    return record


def main() -> None:
    import torch.distributed as dist

    from grpo_core.actor.parallel import init_distributed
    from grpo_core.rollout import SamplingSettings
    from grpo_core.rollout.hf import HFEngine, load_tokenizer
    from tests.dist.sync_worker import build_tiny_llama, prompt_ids

    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    init_distributed()
    hf_dir = Path(args.workdir) / "tiny_llama"
    if dist.get_rank() == 0:
        build_tiny_llama(hf_dir, stop_token=True)
    dist.barrier()

    hf = HFEngine(str(hf_dir), load_tokenizer(str(hf_dir)), dtype="float32")
    prompts = prompt_ids(hf_dir)
    hf_greedy = _as_dict(hf.generate(prompts, SamplingSettings(greedy=True, n=2, max_new_tokens=8)))
    runs: dict[str, list] = {}
    for tp in (2, 1):  # a fresh actor from the checkpoint each time; the HFEngine gets its weights pushed
        record = _check_layout(tp, hf, prompts, hf_dir)
        record["hf_greedy"] = hf_greedy
        diff = _max_diff(record["greedy"]["response_log_probs"], hf_greedy["response_log_probs"])
        record["numbers"]["greedy_logprob_diff"] = diff
        runs[f"tp{tp}"] = [None] * dist.get_world_size()
        dist.all_gather_object(runs[f"tp{tp}"], record)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(runs))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
