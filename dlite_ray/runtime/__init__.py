"""Torch-only runtime: models, paged KV tensors, attention, sampling and verification."""
