"""Architectures by GGUF `general.architecture`, and the aliases that share one."""

from __future__ import annotations

import importlib

from .common import ModelError, UnsupportedModel

# architecture -> module name in this package
ARCHITECTURES = {"llama": "llama", "gemma3": "gemma3", "gemma4": "gemma4", "qwen2": "qwen2",
                 "qwen3": "qwen3", "phi3": "phi3", "smollm3": "smollm3", "mistral3": "mistral3",
                 "bert": "bert", "nomic-bert": "bert",
                 "qwen3moe": "qwen3moe", "qwen2moe": "qwen2moe", "olmoe": "olmoe",
                 "gpt-oss": "gptoss", "qwen35": "qwen35",
                 "qwen35moe": "qwen35"}
ALIASES = {"mistral": "llama"}


def supported() -> list[str]:
    """The architecture names we run, aliases included, sorted."""
    return sorted(set(ARCHITECTURES) | set(ALIASES))


def module_for(meta: dict):
    """The module implementing the file's architecture.

    Raises:
        ModelError: missing or unsupported architecture.
    """
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelError("the file has no general.architecture")
    module_name = ARCHITECTURES.get(ALIASES.get(arch, arch))
    if module_name is None:
        raise ModelError(f"unsupported architecture {arch!r}; supported: {', '.join(supported())}")
    return importlib.import_module(f"{__name__}.{module_name}")


def build(meta: dict, loader, args=None, ctx: int = 0):
    """Construct the model a GGUF file describes.

    Args:
        meta: the file's metadata.
        loader: a WeightLoader over the file and the target backend.
        args: the architecture's ModelArgs, when the caller has already read them.
        ctx: the context size it will run at (0: the file's training context).
    Returns:
        The model object (see models/llama.py for the interface).
    Raises:
        ModelError: unknown architecture or inconsistent metadata/tensors.
    """
    module = module_for(meta)
    if args is None:
        args = module.ModelArgs.from_gguf(meta, meta["general.architecture"])
    return module.Model(args, loader, ctx)


__all__ = ["ARCHITECTURES", "ALIASES", "ModelError", "UnsupportedModel", "build", "module_for",
           "supported"]
