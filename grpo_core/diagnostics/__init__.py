"""Diagnostics of a run: what the loop's phases report besides their timings (phases.py), GPU sampling, profiles,
counters, the hang watchdog and advice after a failure. Kept free of imports: the launcher reads the watchdog's
records without loading torch."""
