"""Run by torchrun from tests/test_weight_sync.py: the megatron actor's weights pushed into HFEngine.

    torchrun --nproc-per-node N tests/dist/sync_worker.py --workdir DIR --out FILE [--megatron-engine]

Rank 0 writes a tiny random Llama (fp32, tied embeddings, the shared SmolLM2 tokenizer) to DIR. Every
rank builds the actor from it (TP = N), does one GRPO update, and pushes the full HF tensors
(``gather_hf_weights`` with ``dst=None``: every rank receives them) into its own HFEngine, loaded from
the same DIR. The engine's teacher-forced log-probs of fixed prompt + response probes are compared with
``actor.compute_log_prob`` before and after the push. With ``--megatron-engine`` the MegatronEngine, on
the actor's own model, then generates greedily next to the synced HFEngine (tokens and log-probs must
agree). Rank 0 writes every rank's numbers as JSON.

The model-building and probe helpers are shared with tests/dist/vllm_worker.py.
"""

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from grpo_core.actor.actor import ActorSettings, MegatronActor
from grpo_core.actor.loss import LossSettings
from grpo_core.actor.parallel import init_distributed, init_model_parallel
from grpo_core.models.bridge import gather_hf_weights
from grpo_core.models.lora import LoRASettings
from grpo_core.models.shape import ModelShape, load_model_shape
from grpo_core.planning.layout import ParallelLayout
from grpo_core.rollout import Generation, to_rollout_batch
from tests.dist.actor_worker import synthetic_batch
from tests.support.tiny import TOKENIZER, tiny_llama

PROMPTS = ["What is 2 + 2?", "Name a colour.", "Natalia sold clips to 48 of her friends in April, how many?"]
# Fixed responses for the log-prob probes, one per prompt, of different lengths (right padding).
PROBE_RESPONSES = [[47, 47, 2], [19484, 6603, 100, 200], [300, 47, 31825, 12947, 5, 2]]


def build_tiny_llama(path: Path, stop_token: bool = False) -> None:
    """fp32, tied embeddings, head_dim 32 (vLLM's CPU attention needs >= 32).

    The final norm is scaled up so the random model is peaked enough to repeat tokens: with
    ``stop_token`` its generation config also stops at prompt 0's first greedy token, so greedy and
    sampled runs end both by EOS ("stop") and by length.
    """
    from transformers import AutoTokenizer

    model = tiny_llama(seed=0, hidden=128).to(torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(10.0)
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    if stop_token:
        prompt = tokenizer.encode(PROMPTS[0])
        first = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=1)[0, -1].item()
        model.generation_config.eos_token_id = [tokenizer.eos_token_id, first]
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def prompt_ids(hf_dir: str | Path) -> list[list[int]]:
    from grpo_core.rollout.hf import load_tokenizer

    tokenizer = load_tokenizer(str(hf_dir))
    return [tokenizer.encode(text) for text in PROMPTS]


def trained_actor(
    hf_dir: str | Path, tp: int, lora: LoRASettings = LoRASettings()
) -> tuple[MegatronActor, ModelShape, dict]:
    """The actor on all ranks (TP = tp), after one GRPO update with advantages +-1 (lr 1e-3); with ``lora``, of
    its adapters (B initialised non-zero, so they act from the start)."""
    shape = load_model_shape(str(hf_dir))
    layout = ParallelLayout(world_size=dist.get_world_size(), tp=tp, pp=1)
    init_model_parallel(layout, seed=7)
    settings = ActorSettings(
        layout=layout,
        lr=1e-3,
        mini_batch_rows=8,
        micro_batch_rows=4,
        loss=LossSettings(use_kl_loss=False),
        lora=lora,
    )
    actor = MegatronActor(shape, settings, hf_path=str(hf_dir))
    batch = synthetic_batch(shape.vocab_size)
    batch.old_log_probs = actor.compute_log_prob(batch)[0]
    metrics = actor.update(batch)
    return actor, shape, metrics


def actor_log_probs(actor: MegatronActor, prompts: list[list[int]], responses: list[list[int]]) -> list[list[float]]:
    gen = Generation(
        prompt_ids=prompts,
        response_ids=responses,
        response_log_probs=[[0.0] * len(r) for r in responses],
        finish_reasons=["length"] * len(responses),
        group_index=list(range(len(responses))),
    )
    log_probs, _ = actor.compute_log_prob(to_rollout_batch(gen, pad_id=0), micro_batch_rows=len(responses))
    return [row[: len(r)].tolist() for row, r in zip(log_probs, responses, strict=True)]


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def push(actor: MegatronActor, shape: ModelShape, engine) -> float:
    """Every rank's engine gets the full tensors; returns the seconds of the whole push."""
    started = time.perf_counter()
    _, tensors = gather_hf_weights(actor.model, shape, dtype=torch.float32)
    engine.update_weights(tensors)
    return time.perf_counter() - started


def hf_log_probs(model, prompts: list[list[int]], responses: list[list[int]]) -> list[list[float]]:
    """Teacher-forced, one unpadded forward per probe."""
    out = []
    with torch.no_grad():
        for prompt, response in zip(prompts, responses, strict=True):
            logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
            out.append(lp.tolist())
    return out


def megatron_engine_check(actor: MegatronActor, hf_engine, prompts: list[list[int]]) -> dict:
    """Greedy tokens and log-probs of the MegatronEngine against the synced HFEngine (every rank generates)."""
    from grpo_core.rollout import SamplingSettings
    from grpo_core.rollout.megatron import MegatronEngine

    engine = MegatronEngine.from_actor(actor, hf_engine.eos_ids, max_sequence_length=64, max_batch_size=4)
    greedy = SamplingSettings(greedy=True, n=1, max_new_tokens=6)
    mine, ref = engine.generate(prompts, greedy), hf_engine.generate(prompts, greedy)
    same = mine.response_ids == ref.response_ids
    return {
        "megatron_same_tokens": same,
        "megatron_logprob_diff": max_diff(mine.response_log_probs, ref.response_log_probs) if same else float("inf"),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--megatron-engine", action="store_true")
    parser.add_argument("--lora", action="store_true", help="also sync a LoRA actor (merged weights)")
    args = parser.parse_args()
    init_distributed()
    hf_dir = Path(args.workdir) / "tiny_llama"
    if dist.get_rank() == 0:
        build_tiny_llama(hf_dir)
    dist.barrier()

    from grpo_core.rollout.hf import HFEngine, load_tokenizer

    engine = HFEngine(str(hf_dir), load_tokenizer(str(hf_dir)), dtype="float32")
    prompts = prompt_ids(hf_dir)
    actor, shape, metrics = trained_actor(hf_dir, tp=dist.get_world_size())
    expected = actor_log_probs(actor, prompts, PROBE_RESPONSES)
    before = max_diff(hf_log_probs(engine.model, prompts, PROBE_RESPONSES), expected)
    seconds = push(actor, shape, engine)
    after = max_diff(hf_log_probs(engine.model, prompts, PROBE_RESPONSES), expected)
    tied = engine.model.lm_head.weight.data_ptr() == engine.model.model.embed_tokens.weight.data_ptr()
    mine = {"before": before, "after": after, "sync_seconds": seconds, "still_tied": tied}
    if args.megatron_engine:
        mine.update(megatron_engine_check(actor, engine, prompts))
    if args.lora:  # the engine gets W + alpha/rank B A: its log-probs are the LoRA actor's
        lora = LoRASettings(rank=4, alpha=8.0, b_init="kaiming", seed=5)
        actor, shape, _ = trained_actor(hf_dir, tp=dist.get_world_size(), lora=lora)
        expected = actor_log_probs(actor, prompts, PROBE_RESPONSES)
        mine["lora_before"] = max_diff(hf_log_probs(engine.model, prompts, PROBE_RESPONSES), expected)
        push(actor, shape, engine)
        mine["lora_after"] = max_diff(hf_log_probs(engine.model, prompts, PROBE_RESPONSES), expected)
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"world": dist.get_world_size(), "metrics": metrics, "ranks": ranks}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
