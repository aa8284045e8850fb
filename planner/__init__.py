"""recpipe.planner: the embedded placement planner (HYBRID / CACHING per table)."""
