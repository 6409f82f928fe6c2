"""The checks of a resolved configuration, made before any process starts: cross-field rules by domain and the
dry run that applies them. Above what they check (config, planning, models, algos, rewards, rollout, tracking)."""
