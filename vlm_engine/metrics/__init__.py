"""Latency metrics: Prometheus-style histograms and the per-request latencies the server exports."""
