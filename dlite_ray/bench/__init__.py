"""Benchmarks: runtime vs transformers, DLite vs plain decoding, reports."""
