"""Parallel layout, per-GPU memory estimates and layout recommendations, computed before any GPU is used."""
