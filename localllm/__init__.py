"""localllm: run GGUF language models locally."""

__version__ = "0.1.0"
