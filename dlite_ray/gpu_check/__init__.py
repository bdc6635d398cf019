"""`dlite-ray gpu-check`: the device session's proof of the GPU path (see run.py)."""
