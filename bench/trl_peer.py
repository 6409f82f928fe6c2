"""The nearest single-GPU peer on `bench/grpo_step.sh`'s work: TRL's ``GRPOTrainer``, timed per GRPO step.

    python3 bench/trl_peer.py MODEL_DIR DATA_DIR OUT.json [--steps 3] [--continuous-batching] [--recompute]
                              [--lora-rank R]

The same work as the project's run: MODEL_DIR's weights in bf16, the first prompts of DATA_DIR/train.parquet
(`grpo prepare`) in order, 64 prompts x 8 samples x at most 256 new tokens at temperature 1 per GRPO step, two
optimizer steps of 256 completions each in micro-batches of 16, PPO clip 0.2, a k3 KL to the reference at 0.001,
a token-level loss, the project's GSM8K reward (format bonus 0.1). Tokens/s per GPU as the project counts it
(``perf/throughput``): prompt + response tokens, no padding, over the GRPO step's seconds. Needs trl and datasets
(and peft for LoRA).

The peer runs at its fastest settings that fit: gradient checkpointing off (TRL's GRPOConfig turns it on by
default; on one H100 its 1.5B steps took 23.9 / 27.1 s without it, 27.8 / 29.9 s with it, issue 39), unless
--recompute asks for TRL's default. --lora-rank R trains peft's LoRA adapters (alpha 2R, every linear layer), the
setting TRL users pair with a 7B on one GPU.
"""

import argparse
import json
import time
from pathlib import Path

import torch

from grpo_core.data.prompts import chat_prompt_ids, load_rows
from grpo_core.rewards.gsm8k import compute_score

PROMPTS, SAMPLES, NEW_TOKENS, MICRO, OPT_STEPS = 64, 8, 256, 16, 2


def gsm8k_reward(completions, ground_truth, **_) -> list[float]:
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [compute_score(t, g, format_score=0.1) for t, g in zip(texts, ground_truth, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("data")
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps (the first includes loading and warm-up)")
    parser.add_argument("--continuous-batching", action="store_true", help="transformers' continuous batching")
    parser.add_argument("--recompute", action="store_true", help="gradient checkpointing on (TRL's default)")
    parser.add_argument("--lora-rank", type=int, default=0, help="peft LoRA adapters of this rank (0: full training)")
    args = parser.parse_args()

    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    rows = load_rows(f"{args.data}/train.parquet", PROMPTS * args.steps)
    messages = [[dict(m) for m in r["prompt"]] for r in rows]
    truths = [str(r["reward_model"]["ground_truth"]) for r in rows]
    prompt_tokens = [len(chat_prompt_ids(tokenizer, m)) for m in messages]

    class Clock(TrainerCallback):
        """Wall time at every optimizer step's end (the GPU drained first)."""

        def __init__(self) -> None:
            self.times = [time.perf_counter()]

        def on_step_end(self, *_, **__):
            torch.cuda.synchronize()
            self.times.append(time.perf_counter())

    config = GRPOConfig(
        output_dir="/tmp/trl-peer",
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=PROMPTS * SAMPLES // OPT_STEPS // MICRO,
        num_generations=SAMPLES,
        generation_batch_size=PROMPTS * SAMPLES,
        max_completion_length=NEW_TOKENS,
        temperature=1.0,
        top_p=1.0,
        epsilon=0.2,
        beta=0.001,
        loss_type="dapo",  # token-level: every token of the batch weighs the same (the project's token-mean)
        learning_rate=2e-5,
        max_steps=OPT_STEPS * args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=True,
        shuffle_dataset=False,
        model_init_kwargs={"dtype": torch.bfloat16},
        use_transformers_continuous_batching=args.continuous_batching,
        gradient_checkpointing=args.recompute,
    )
    peft_config = None
    if args.lora_rank:
        from peft import LoraConfig

        peft_config = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules="all-linear")
    clock = Clock()
    dataset = Dataset.from_dict({"prompt": messages, "ground_truth": truths})
    trainer = GRPOTrainer(
        model=args.model,
        reward_funcs=gsm8k_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    trainer.add_callback(clock)
    trainer.train()
    # TRL logs a generation's mean completion length once per generation (the GRPO step's first optimizer step)
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    per_step = len(lengths) // args.steps if len(lengths) >= args.steps else 0
    steps = []
    for i in range(args.steps):
        seconds = clock.times[OPT_STEPS * (i + 1)] - clock.times[OPT_STEPS * i]
        mean_length = sum(lengths[per_step * i : per_step * (i + 1)]) / per_step if per_step else NEW_TOKENS
        response = mean_length * PROMPTS * SAMPLES
        tokens = sum(prompt_tokens[PROMPTS * i : PROMPTS * (i + 1)]) * SAMPLES + response
        steps.append({"step": i + 1, "seconds": seconds, "tokens": tokens, "tokens_per_s_per_gpu": tokens / seconds})
    import trl

    result = {
        "implementation": f"TRL {trl.__version__} GRPOTrainer, "
        + ("continuous batching" if args.continuous_batching else "transformers generate")
        + (", gradient checkpointing" if args.recompute else "")
        + (f", peft LoRA rank {args.lora_rank}" if args.lora_rank else ""),
        "steps": steps,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }
    args.out.write_text(json.dumps(result, indent=1))
    for s in steps:
        rate = s["tokens_per_s_per_gpu"]
        print(f"{result['implementation']} step {s['step']}: {s['seconds']:.2f} s, {rate:,.0f} tok/s/GPU")
    print(f"peak {result['peak_gib']:.1f} GiB")


if __name__ == "__main__":
    main()
