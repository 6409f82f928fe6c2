"""A smoke-test task any model can learn from scratch: answer in capital letters.

The reward is the share of the response's letters that are upper case (0 without letters), so a
randomly initialised model starts low (about 0.06 of the letters in a Llama/SmolLM2 vocabulary are
capitals) and GRPO has a signal from the first step. Used by the learning test; ``ground_truth`` is
ignored.
"""


def compute_score(solution_str: str, ground_truth: str = "", **_) -> float:
    letters = [c for c in solution_str if c.isalpha()]
    if not letters:
        return 0.0
    return sum(c.isupper() for c in letters) / len(letters)
