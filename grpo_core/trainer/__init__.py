"""The GRPO training loop that every rank runs (loop.py): its set-up (setup.py), a step's rollouts and scores
(rollouts.py) and advantages (advantages.py), its metrics and its stop conditions."""
