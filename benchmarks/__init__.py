"""Benchmarks run as modules (``python -m benchmarks.NAME``), importing bert_cluster's public names only."""
