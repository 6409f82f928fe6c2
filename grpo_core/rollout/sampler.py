"""The static engine's sampler: a token per row from the logits, and its log-prob, without a host round trip.

Both draws invert the CDF in two levels (a block of ``SAMPLE_BLOCK`` vocabulary columns, then a column in it), one
random number a row: ``sample`` for GPUs (compiled, captured in the decode step's CUDA graph), ``sample_on_cpu``
for eager CPU steps. Both return the model's temperature-1 log-prob of the token drawn, whatever the settings.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

SAMPLE_BLOCK = 128  # vocabulary columns per block of the sampler's two-level inverse CDF (151,936 = 1,187 x 128)


def sample(
    logits: torch.Tensor, temperature: torch.Tensor, greedy: bool, top_k: int, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [b, V] -> (sampled token [b], its log-prob under the model at temperature 1 [b]).

    No host round trip, so it can be captured in a CUDA graph; on GPUs it runs compiled, where the
    normaliser below and the sampler's block masses come from one read of the logits."""
    logits = logits.float()
    top, sums = block_stats(logits)
    peak = top.amax(-1)
    log_z = peak + (sums * (top - peak[:, None]).exp()).sum(-1).log()  # logsumexp(logits)
    token = logits.argmax(-1) if greedy else inverse_cdf(truncate(logits / temperature, top_k, top_p))
    log_prob = logits.gather(-1, token.unsqueeze(-1)).squeeze(-1) - log_z
    return token, log_prob


def sample_on_cpu(
    logits: torch.Tensor, temperature: torch.Tensor, greedy: bool, top_k: int, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample`` for eager CPU steps: the same draw by inverse CDF, its masses from torch's softmax kernel (one
    fused pass with a fast exp). ``block_stats``' pad, exp and sums, run twice, took 1.09 ms of the demo's decode
    step (16 x 49,152 logits) eagerly; this takes about a third of that (bench/cpu_step.py)."""
    if greedy:  # (bf16's argmax took 1.2 ms here)
        log_prob, token = torch.log_softmax(logits, -1, dtype=torch.float32).max(-1)
        return token, log_prob
    plain = float(temperature) == 1.0 and top_k <= 0 and top_p >= 1.0  # the model's own distribution
    scaled = logits if plain else truncate(logits.float() / temperature, top_k, top_p)
    probs = torch.softmax(scaled, -1, dtype=torch.float32)
    b, vocab = probs.shape
    padded = F.pad(probs, (0, -vocab % SAMPLE_BLOCK)) if vocab % SAMPLE_BLOCK else probs
    token = draw(
        padded.view(b, -1, SAMPLE_BLOCK).sum(-1),
        lambda columns: probs.gather(1, columns.clamp(max=vocab - 1)).masked_fill(columns >= vocab, 0.0),
    )
    if plain:  # > 0: the draw never lands on a column of weight 0
        return token, probs.gather(1, token[:, None]).squeeze(1).log()
    return token, torch.log_softmax(logits, -1, dtype=torch.float32).gather(1, token[:, None]).squeeze(1)


def truncate(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``scaled`` logits [b, V] with -inf outside each row's ``top_k`` and its nucleus of mass ``top_p``."""
    if top_k > 0:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = scaled.sort(dim=-1, descending=True)
        probs = ordered.softmax(-1)
        before = probs.cumsum(-1) - probs  # the mass of the tokens ranked above
        scaled = scaled.scatter(-1, order, ordered.masked_fill(before > top_p, float("-inf")))
    return scaled


def block_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [b, V] -> each block of ``SAMPLE_BLOCK`` columns' max and sum of exp(x - max), [b, blocks] each: the
    softmax's pieces from a single read of ``x`` (a block is reduced in registers). A block with no finite
    column gets a finite max, so its sum is 0, not NaN."""
    b, vocab = x.shape
    blocks = F.pad(x, (0, -vocab % SAMPLE_BLOCK), value=float("-inf")).view(b, -1, SAMPLE_BLOCK)
    top = blocks.amax(-1).clamp(min=torch.finfo(torch.float32).min)
    return top, (blocks - top[..., None]).exp().sum(-1)


def inverse_cdf(scaled: torch.Tensor) -> torch.Tensor:
    """A token per row drawn from softmax(``scaled``) [b, V] (``draw``, the blocks' masses from ``block_stats``,
    a block's column weights recomputed from its own columns: nothing vocabulary-sized is written)."""
    vocab = scaled.shape[1]
    top, sums = block_stats(scaled)
    peak = top.amax(-1, keepdim=True)

    def weights(columns: torch.Tensor) -> torch.Tensor:  # on the masses' scale
        chosen = scaled.gather(1, columns.clamp(max=vocab - 1)).masked_fill(columns >= vocab, float("-inf"))
        return (chosen - peak).exp()

    return draw(sums * (top - peak).exp(), weights)


def draw(masses: torch.Tensor, weights: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """A column per row by inverting the CDF in two levels: a block of ``SAMPLE_BLOCK`` columns by the blocks'
    ``masses`` [b, blocks], then a column within it by ``weights(columns)`` [b, BLOCK] (on the masses' scale, 0
    past the vocabulary). One random number a row, where Gumbel-max drew one per logit (a 311 MB noise tensor at
    512 x 151,936)."""
    b = masses.shape[0]
    mass = masses.cumsum(-1)  # [b, blocks]: the mass up to and including each block
    # u in (0, 1], so the target is > 0 and the column found has a positive weight
    target = (1.0 - torch.rand(b, 1, device=masses.device)) * mass[:, -1:]
    block = torch.searchsorted(mass, target).clamp(max=mass.shape[1] - 1)  # first block reaching the target
    before = torch.where(block > 0, mass.gather(1, (block - 1).clamp(min=0)), 0.0)
    columns = block * SAMPLE_BLOCK + torch.arange(SAMPLE_BLOCK, device=masses.device)  # [b, BLOCK]
    inside = weights(columns).cumsum(-1)
    rest = torch.minimum(target - before, inside[:, -1:])  # > 0; at most the block's own sum (rounding)
    column = torch.searchsorted(inside, rest)
    return (block * SAMPLE_BLOCK + column).squeeze(1)


# fallback_random: the draws come from torch's own generator (as in eager), which CUDA graphs can capture
sample_compiled = torch.compile(sample, options={"fallback_random": True})
