"""localllm: run GGUF language models locally."""

__version__ = "0.1.0"

__all__ = ["load", "Model", "LoadSettings", "SamplingParams", "configure_process",
           "ProcessConfig", "__version__"]


def __getattr__(name):
    # Imported on first use so that light commands (fetching, listing) skip the kernels.
    if name in ("load", "Model", "LoadSettings", "configure_process", "ProcessConfig"):
        from . import api
        return getattr(api, name)
    if name == "SamplingParams":
        from .generation.sampling import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'localllm' has no attribute {name!r}")
