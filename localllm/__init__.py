"""localllm: run GGUF language models locally."""

from .errors import (BadSetting, ConstraintError, ContextFull, EmptyPrompt, EngineError,
                     FetchError, GGUFError, GrammarError, KVPoolFull, LocalLLMError,
                     ModelFileError, NotEnoughMemory, PromptTooLong, SequenceError,
                     TemplateError, TokenizerError, TokenOutOfVocab, UnsupportedModel)

__version__ = "0.1.0"

__all__ = ["load", "Model", "LoadSettings", "SamplingParams", "configure_process",
           "ProcessConfig", "ToolCall", "__version__",
           "BadSetting", "ConstraintError", "ContextFull", "EmptyPrompt", "EngineError",
           "FetchError", "GGUFError", "GrammarError", "KVPoolFull", "LocalLLMError",
           "ModelFileError", "NotEnoughMemory", "PromptTooLong", "SequenceError",
           "TemplateError", "TokenizerError", "TokenOutOfVocab", "UnsupportedModel"]


def __getattr__(name):
    # Imported on first use so that light commands (fetching, listing) skip the kernels;
    # the errors module imports nothing, so it comes at once.
    if name in ("load", "Model", "LoadSettings", "configure_process", "ProcessConfig"):
        from . import api
        return getattr(api, name)
    if name == "SamplingParams":
        from .generation.sampling import SamplingParams
        return SamplingParams
    if name == "ToolCall":
        from .text.tool_calls import ToolCall
        return ToolCall
    raise AttributeError(f"module 'localllm' has no attribute {name!r}")
