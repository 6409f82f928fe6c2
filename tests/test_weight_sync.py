"""Weight sync from the megatron actor into HFEngine, at 1, 2 and 4 processes (TP1, TP2, TP4).

After one GRPO update the actor's full HF tensors go to every rank's engine (gather_hf_weights with
dst=None); the engine's teacher-forced log-probs must then equal the actor's, and must not before.
The tiny Llama has 2 KV heads, so at TP4 each KV head serves two ranks (megatron's QKV rows cut through
a query group); there the MegatronEngine's greedy generation is also checked against the synced HFEngine.
The actor runs in torchrun workers (tests/dist/sync_worker.py), so this process never imports it.
"""

import json

import pytest

from tests.dist.launch import torchrun
from tests.support.tiny import TOKENIZER

TOL = 1e-4


@pytest.fixture(scope="module", params=[1, 2, 4], ids=["tp1", "tp2", "tp4"])
def record(request, tmp_path_factory) -> dict:
    if not TOKENIZER.is_dir():
        pytest.skip(f"{TOKENIZER} (the shared SmolLM2 tokenizer) is not present")
    workdir = tmp_path_factory.mktemp(f"sync{request.param}")
    out = workdir / "record.json"
    above_kv_heads = ["--megatron-engine"] if request.param > 2 else []
    lora = ["--lora"] if request.param == 2 else []  # the TP2 launch also syncs a LoRA actor's merged weights
    torchrun("sync_worker.py", request.param, "--workdir", str(workdir), "--out", str(out), *above_kv_heads, *lora)
    record = json.loads(out.read_text())
    print(f"x{request.param}:", json.dumps(record["ranks"]))  # numbers for -s / failure reports
    return record


def test_hf_engine_matches_actor_after_sync(record):
    assert len(record["ranks"]) == record["world"]
    assert record["metrics"]["actor/grad_norm"] > 0, record["metrics"]
    for rank, numbers in enumerate(record["ranks"]):
        assert numbers["before"] > 1e-3, f"rank {rank}: the update did not move the log-probs: {numbers}"
        assert numbers["after"] <= TOL, f"rank {rank}: engine and actor differ by {numbers['after']:.2e} after sync"
        assert numbers["still_tied"], f"rank {rank}: the push untied lm_head from the embedding"


@pytest.mark.parametrize("record", [4], ids=["tp4"], indirect=True)  # TP above the 2 KV heads
def test_megatron_engine_above_the_kv_heads(record):
    for rank, numbers in enumerate(record["ranks"]):
        assert numbers["megatron_same_tokens"], f"rank {rank}: greedy tokens differ from HFEngine's"
        assert numbers["megatron_logprob_diff"] <= TOL, f"rank {rank}: {numbers}"


@pytest.mark.parametrize("record", [2], ids=["tp2"], indirect=True)
def test_hf_engine_matches_a_lora_actor_after_sync(record):
    for rank, numbers in enumerate(record["ranks"]):
        assert numbers["lora_before"] > 1e-3, f"rank {rank}: the LoRA actor is the full-parameter one: {numbers}"
        assert numbers["lora_after"] <= TOL, f"rank {rank}: engine and LoRA actor differ after sync: {numbers}"
