"""Distil a DLite draft for a target: offline prompts, target features, losses, training loop."""
