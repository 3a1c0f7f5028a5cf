"""Exact evaluation: padded eval batches, weighted cross-rank metrics, per-class reports, sample bias."""
