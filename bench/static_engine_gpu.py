"""The static engine on a GPU against the fp32 model it serves, in each of its GPU modes: the cascade attention
replayed as CUDA graphs (the default), SDPA replayed as graphs, and SDPA eagerly. CI has no GPU, so the engine's
graph captures, the cascade's Triton kernels and the compiled GPU functions are checked here, on the lent machine.

    python bench/static_engine_gpu.py        (bench/gpu_call.sh runs it in bench/static_engine_gpu.sh)

Random 2-layer Llama, Qwen2 (QKV biases) and Qwen3 (q/k norms) models, fp32 weights, three left-padded prompts.
Per mode: greedy and sampled (n=4) generations, the largest gap between the engine's log-probs and the model's
own for the same tokens, and whether the greedy tokens equal transformers' greedy ones. Prints a table last.
"""

import sys
import tempfile

import torch

from grpo_core.models.shape import load_model_shape
from grpo_core.rollout.base import SamplingSettings
from grpo_core.rollout.static import StaticEngine

PROMPTS = [[5, 17, 33, 250, 7], [9, 100], [44, 45, 46, 47, 48, 49, 50, 51, 52]]
MODES = {"cascade, graphs": ("cascade", True), "sdpa, graphs": ("sdpa", True), "sdpa, eager": ("sdpa", False)}


def tiny(kind: str, directory: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=512, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2)  # fmt: skip
    torch.manual_seed(0)
    model = {
        "llama": lambda: LlamaForCausalLM(LlamaConfig(**common)),
        "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=False, **common)),
        "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(tie_word_embeddings=False, head_dim=32, **common)),
    }[kind]()
    if kind == "qwen2":
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.2)
    model.save_pretrained(directory)
    return model.cuda().eval(), load_model_shape(directory)


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
            model, shape = tiny(kind, directory)
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
