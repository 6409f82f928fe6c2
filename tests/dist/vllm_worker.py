"""Run by torchrun (1 process, gloo) from tests/test_rollout_vllm.py: one VLLMEngine, every check.

    torchrun --nproc-per-node 1 tests/dist/vllm_worker.py --workdir DIR --out FILE

Starting vLLM takes a minute or two here, so one engine serves all checks and the test only reads the
JSON record this writes. The engine is started as the trainer will start it: torch.distributed is
initialised and the megatron actor (with grpo_core.cpu_compat's process-wide CUDA-to-CPU mode) is
imported at the top of this script, which vLLM's spawned processes must not re-import.

Checks, against transformers on the same tiny fp32 model (tests/dist/sync_worker.py builds it; its
generation config adds a stop token, so samples end by EOS and by length):
  greedy   token ids, finish reasons and log-probs equal HFEngine's greedy ones
  sampled  n samples per prompt, grouped; finish reasons fit the tokens; log-probs equal a
           teacher-forced transformers forward of the same tokens
  sync     after one GRPO update of the megatron actor, gather_hf_weights -> update_weights makes the
           engine's log-probs of fixed probes equal actor.compute_log_prob (and they differ before)
  bad_push an unknown name raises at once and leaves the engine working with its weights unchanged
  close    no vLLM process is left
"""

import argparse
import json
import os
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

from grpo_core.actor.parallel import init_distributed
from grpo_core.rollout import SamplingSettings
from tests.dist.sync_worker import (
    PROBE_RESPONSES,
    actor_log_probs,
    build_tiny_llama,
    hf_log_probs,
    max_diff,
    prompt_ids,
    push,
    trained_actor,
)


def vllm_children() -> list[str]:
    """Command lines of this process's descendants, apart from multiprocessing's resource tracker."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            cmdline = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "resource_tracker" not in cmdline:
            found.append(f"{child.pid} {child.name()} {cmdline[:200]}")
    return found


def check_greedy(engine, hf_engine, prompts) -> dict:
    settings = SamplingSettings(greedy=True, n=2, max_new_tokens=8)
    ours, ref = engine.generate(prompts, settings), hf_engine.generate(prompts, settings)
    return {
        "engine": ours.response_ids,
        "hf": ref.response_ids,
        "engine_reasons": ours.finish_reasons,
        "hf_reasons": ref.finish_reasons,
        "group_index": ours.group_index,
        "max_logprob_diff": max_diff(ours.response_log_probs, ref.response_log_probs),
    }


def check_sampled(engine, hf_model, prompts) -> dict:
    settings = SamplingSettings(n=4, temperature=0.9, top_p=0.95, top_k=50, max_new_tokens=8, seed=3)
    gen = engine.generate(prompts, settings)
    teacher = hf_log_probs(hf_model, [prompts[g] for g in gen.group_index], gen.response_ids)
    return {
        "n": settings.n,
        "max_new_tokens": settings.max_new_tokens,
        "prompt_ids": gen.prompt_ids,
        "response_ids": gen.response_ids,
        "finish_reasons": gen.finish_reasons,
        "group_index": gen.group_index,
        "lengths_match": [len(r) == len(lp) for r, lp in zip(gen.response_ids, gen.response_log_probs, strict=True)],
        "max_logprob_diff": max_diff(gen.response_log_probs, teacher),
    }


def check_bad_push(engine, prompts) -> dict:
    before = engine.score(prompts, PROBE_RESPONSES)
    try:
        engine.update_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(256, 128))])
        error = None
    except KeyError as exc:
        error = str(exc)
    after = engine.score(prompts, PROBE_RESPONSES)
    return {"error": error, "unchanged_diff": max_diff(before, after)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--eager", action="store_true")
    args = parser.parse_args()
    init_distributed()
    hf_dir = Path(args.workdir) / "tiny_llama"
    build_tiny_llama(hf_dir, stop_token=True)
    prompts = prompt_ids(hf_dir)

    from grpo_core.rollout.hf import HFEngine, load_tokenizer
    from grpo_core.rollout.vllm import VLLMEngine, VLLMMissingError

    record: dict = {}
    env_before = dict(os.environ)
    try:
        engine = VLLMEngine(
            str(hf_dir),
            dtype="float32",
            seed=0,
            max_model_len=512,
            max_num_seqs=16,
            kv_cache_memory_bytes=256 << 20,
            enforce_eager=args.eager,
        )
    except VLLMMissingError as exc:
        Path(args.out).write_text(json.dumps({"vllm_missing": str(exc)}))
        dist.destroy_process_group()
        return
    record["start_seconds"] = engine.start_seconds
    env_after = dict(os.environ)
    record["env_changes"] = {
        name: [env_before.get(name), env_after.get(name)]
        for name in set(env_before) | set(env_after)
        if env_before.get(name) != env_after.get(name)
    }
    record["eos_ids"] = engine.eos_ids
    record["children_running"] = len(vllm_children())
    hf_engine = HFEngine(str(hf_dir), load_tokenizer(str(hf_dir)), dtype="float32")
    record["hf_eos_ids"] = hf_engine.eos_ids

    record["greedy"] = check_greedy(engine, hf_engine, prompts)
    record["sampled"] = check_sampled(engine, hf_engine.model, prompts)

    actor, shape, metrics = trained_actor(hf_dir, tp=1)
    expected = actor_log_probs(actor, prompts, PROBE_RESPONSES)
    sync = {"actor_grad_norm": metrics["actor/grad_norm"]}
    sync["before"] = max_diff(engine.score(prompts, PROBE_RESPONSES), expected)
    engine.bucket_bytes = 200_000  # many buckets: a layer's q/k/v and gate/up end up in different ones
    sync["seconds"] = push(actor, shape, engine)
    sync["engine_sync_seconds"] = engine.sync_seconds
    last = engine.last_sync
    sync |= {"tensors": last.tensors, "bytes": last.bytes, "buckets": last.buckets, "not_updated": last.not_updated}
    sync["after"] = max_diff(engine.score(prompts, PROBE_RESPONSES), expected)
    # The sampled log-probs come from the new weights too: greedy samples scored by the actor.
    greedy = engine.generate(prompts, SamplingSettings(greedy=True, max_new_tokens=6))
    sync["greedy_after"] = max_diff(greedy.response_log_probs, actor_log_probs(actor, prompts, greedy.response_ids))
    record["sync"] = sync
    record["bad_push"] = check_bad_push(engine, prompts)

    engine.sleep(), engine.wake()  # no-ops on CPU
    started = time.perf_counter()
    engine.close()
    record["close_seconds"] = time.perf_counter() - started
    time.sleep(1.0)
    record["children_after_close"] = vllm_children()
    Path(args.out).write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
