"""The static engine on a GPU against the fp32 model it serves, in each of its GPU modes: the cascade attention
replayed as CUDA graphs (the default), SDPA replayed as graphs, and SDPA eagerly. CI has no GPU, so the engine's
graph captures, the cascade's Triton kernels and the compiled GPU functions are checked here, on the lent machine.

    PYTHONPATH=$PWD python3 bench/static_engine_gpu.py     (from the repo root on the lent machine)

The suite's random 2-layer Llama, Qwen2 (QKV biases) and Qwen3 (q/k norms) models (tests/test_rollout_static.py),
fp32 weights, its three left-padded prompts (head size 16, which the cascade takes).
Per mode: greedy and sampled (n=4) generations, the largest gap between the engine's log-probs and the model's
own for the same tokens, and whether the greedy tokens equal transformers' greedy ones. Prints a table last.
"""

import sys
import tempfile
from pathlib import Path

import torch

from grpo_core.rollout.base import SamplingSettings
from grpo_core.rollout.static import StaticEngine
from tests.test_rollout_static import PROMPTS, tiny  # the suite's models (run from the repo root)

MODES = {"cascade, graphs": ("cascade", True), "sdpa, graphs": ("sdpa", True), "sdpa, eager": ("sdpa", False)}


def fidelity(model, prompts, gen) -> float:
    """The largest gap between the generation's log-probs and the fp32 model's for the same tokens."""
    worst = 0.0
    for row, (response, log_probs) in enumerate(zip(gen.response_ids, gen.response_log_probs, strict=True)):
        prompt = prompts[gen.group_index[row]]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response], device="cuda")).logits[0, len(prompt) - 1 : -1]
        want = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(response, device="cuda")[:, None])
        worst = max(worst, (torch.tensor(log_probs, device="cuda") - want[:, 0]).abs().max().item())
    return worst


def main() -> int:
    rows, failed = [], False
    for kind in ("llama", "qwen2", "qwen3"):
        with tempfile.TemporaryDirectory() as directory:
            model, shape = tiny(kind, Path(directory))
        model = model.cuda().eval()
        with torch.no_grad():
            want = [
                model.generate(torch.tensor([p], device="cuda"), max_new_tokens=12, do_sample=False)[0, len(p) :]
                for p in PROMPTS
            ]
        for mode, (attention, graphs) in MODES.items():
            engine = StaticEngine(
                shape, [-1], "float32", "cuda", max_batch_size=8, max_model_len=128, cuda_graphs=graphs,
                attention=attention,
            )  # fmt: skip
            engine.update_weights(model.state_dict().items())
            greedy = engine.generate(PROMPTS, SamplingSettings(n=1, temperature=0.0, max_new_tokens=12))
            sampled = engine.generate(PROMPTS, SamplingSettings(n=4, temperature=0.9, max_new_tokens=12, seed=1))
            same = sum(g == w.tolist() for g, w in zip(greedy.response_ids, want, strict=True))
            gaps = fidelity(model, PROMPTS, greedy), fidelity(model, PROMPTS, sampled)
            ok = same == len(PROMPTS) and max(gaps) < 2e-2  # TF32 in the cascade's products
            failed |= not ok
            verdict = "ok" if ok else "FAIL"
            rows.append(f"| {kind} | {mode} | {same}/{len(PROMPTS)} | {gaps[0]:.1e} | {gaps[1]:.1e} | {verdict} |")
    print("| model | engine mode | greedy = transformers | log-prob gap, greedy | sampled (n=4) | |")
    print("| --- | --- | --- | --- | --- | --- |")
    print(*rows, sep="\n")
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
