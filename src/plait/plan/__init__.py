"""``plait plan``: which layout fits, and how fast it runs (issue 16)."""
