"""Checkpointing megatron's distributed optimizer when it runs torch's Adam (no Apex, no Transformer Engine).

That is the set-up on CPU and on GPU machines without those packages, and megatron-core (0.16-0.19)
mishandles it in four places, each worked around here and covered by tests/test_checkpoint.py:
1. a fresh optimizer has no Adam state, and megatron cannot describe it for loading (``assert len(steps) == 1``);
2. loading copies Adam's ``step`` from tensors that leave it out ("fully_reshardable": a KeyError) or that hold the
   fresh optimizer's own step ("dp_reshardable", which does not save it: the step would restart at 0);
3. the restored ``step`` is one tensor shared by all parameters, which Adam then increments once per
   parameter per step, corrupting the bias correction;
4. loading the "dp_reshardable" format copies into the fp32 master weights with autograd on (an error).
"""

import torch


def _chained(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def zero_adam_states(optimizer) -> None:
    """(1) Give a fresh optimizer zero Adam states for the checkpoint to load into."""
    for opt in _chained(optimizer):
        inner = opt.optimizer
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state.get(p):
                    zeros = torch.zeros_like(p)
                    inner.state[p] = {"step": torch.tensor(0.0), "exp_avg": zeros, "exp_avg_sq": zeros.clone()}


def _keep_step_on_load(opt) -> None:
    """(2) Supply the step megatron already restored (from the param groups), so copying that key is a no-op."""
    original = getattr(opt, "_set_main_param_and_optimizer_states", None)
    if original is None or getattr(original, "_keeps_step", False):
        return

    def set_states(model_param, tensors):
        group, order = opt.model_param_group_index_map[model_param]
        main_param = opt.optimizer.param_groups[group]["params"][order]
        step = opt.optimizer.state.get(main_param, {}).get("step")
        if step is not None:  # "dp_reshardable" hands over the fresh optimizer's own step (not saved): replaced too
            tensors = {**tensors, "step": step.clone()}
        return original(model_param, tensors)

    set_states._keeps_step = True
    opt._set_main_param_and_optimizer_states = set_states


def load(optimizer, state: dict) -> None:
    """Load a dist-checkpointed optimizer state, then (3) give every parameter its own ``step``."""
    for opt in _chained(optimizer):
        _keep_step_on_load(opt)
    with torch.no_grad():  # (4)
        optimizer.load_state_dict(state)
    for opt in _chained(optimizer):
        for param_state in opt.optimizer.state.values():
            if isinstance(param_state.get("step"), torch.Tensor):
                param_state["step"] = param_state["step"].clone()
