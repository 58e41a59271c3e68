"""Models and per-rank workers that the checkpoint tests spawn in separate processes."""
