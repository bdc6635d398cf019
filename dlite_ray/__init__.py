"""dlite-ray: history-free speculative decoding (DLite) for agent workloads."""

__version__ = "0.1.0"

__all__ = ["DLiteEngine", "__version__"]


def __getattr__(name: str):
    # Lazy so that `import dlite_ray` stays cheap (no torch import) for the CLI's --help.
    if name == "DLiteEngine":
        from dlite_ray.engine.engine import DLiteEngine

        return DLiteEngine
    raise AttributeError(name)
