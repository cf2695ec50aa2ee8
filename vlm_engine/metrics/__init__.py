"""Metrics: core-side histograms that travel between processes, the per-request tracker, the request log, the status line and the profiler."""
