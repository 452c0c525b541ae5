"""The typed errors of localllm: one base, ``LocalLLMError``, and a class per kind of failure,
each naming the setting or request field at fault in ``.param``. The lowest layer: it imports
nothing of ours, and every layer raises from here; the apps map the classes to exit codes and
HTTP statuses in one table each."""

from __future__ import annotations


class LocalLLMError(Exception):
    """Any failure localllm reports on purpose (not a bug).

    Attributes:
        param: the setting or request field at fault (e.g. "ctx_size", "prompt"), or None.
    """

    def __init__(self, message: str = "", *, param: str | None = None):
        super().__init__(message)
        self.param = param


# ----------------------------------------------------------------------------- model files

class ModelFileError(LocalLLMError, ValueError):
    """A model file that cannot be used: malformed, or asking for what is not supported."""


class GGUFError(ModelFileError):
    """A malformed or unsupported GGUF file.

    Attributes:
        field: which field is wrong, e.g. "tensor_info[3].offset" or "kv[5].value[17]".
        offset: absolute byte offset of that field in the file.
    """

    def __init__(self, message: str, field: str, offset: int):
        super().__init__(message)
        # All three in args, so the exception pickles (e.g. across worker processes).
        self.args = (message, field, offset)
        self.message = message
        self.field = field
        self.offset = offset

    def __str__(self) -> str:
        return f"{self.message} [field {self.field} at byte {self.offset}]"


class UnsupportedModel(ModelFileError):
    """A well-formed file whose model cannot be built: an unknown architecture, metadata out
    of range, a tensor missing or of the wrong shape."""


class TokenizerError(LocalLLMError, ValueError):
    """A tokenizer the file describes badly, or text or ids it cannot encode or decode."""


class TemplateError(LocalLLMError, ValueError):
    """A chat template that does not compile, cannot be found, or refuses a conversation."""


# ----------------------------------------------------------------------------- the engine

class EngineError(LocalLLMError, ValueError):
    """A request or setting the engine refuses; the base of the kinds below, kept so that
    ``except EngineError`` catches each of them."""


class BadSetting(EngineError):
    """An invalid load or sampling setting (context size, KV types, GPU layers, speculation,
    temperature...); ``param`` names it."""


class NotEnoughMemory(EngineError):
    """The model and its KV cache do not fit the memory there is (the message names the
    numbers); ``param`` names the setting that would make room, where one would."""


class EmptyPrompt(EngineError):
    """A prompt, or a step of a sequence, with no tokens."""


class ContextFull(EngineError):
    """A sequence would grow past the context size."""


class PromptTooLong(ContextFull):
    """A prompt that leaves no room in the context for a reply.

    Attributes:
        n_tokens: the prompt's length in tokens.
        ctx: the context size.
    """

    def __init__(self, message: str = "", *, param: str | None = None, n_tokens: int = 0,
                 ctx: int = 0):
        super().__init__(message, param=param)
        self.n_tokens = n_tokens
        self.ctx = ctx


class TokenOutOfVocab(EngineError):
    """A token id outside the model's vocabulary.

    Attributes:
        token: the first such id.
        vocab_size: the size of the vocabulary.
    """

    def __init__(self, message: str = "", *, param: str | None = None, token: int = 0,
                 vocab_size: int = 0):
        super().__init__(message, param=param)
        self.token = token
        self.vocab_size = vocab_size


class KVPoolFull(EngineError, RuntimeError):
    """Every block of a KV pool is in use. A RuntimeError as the pool's own exhaustion always
    was, and a ValueError as the engine's refusals are."""


class SequenceError(EngineError):
    """A sequence used in a way it cannot be: after its release, trimmed past its length,
    twice in one step."""


# ----------------------------------------------------------------------------- generation

class GrammarError(LocalLLMError, ValueError):
    """A grammar or JSON schema the constraint compiler does not support, naming why."""


class ConstraintError(LocalLLMError, ValueError):
    """A constraint that allows no next token (a grammar with a dead end), or a token it
    does not allow."""


# ----------------------------------------------------------------------------- fetching

class FetchError(LocalLLMError, RuntimeError):
    """A model could not be fetched or failed its checksum."""


__all__ = ["BadSetting", "ConstraintError", "ContextFull", "EmptyPrompt", "EngineError",
           "FetchError", "GGUFError", "GrammarError", "KVPoolFull", "LocalLLMError",
           "ModelFileError", "NotEnoughMemory", "PromptTooLong", "SequenceError",
           "TemplateError", "TokenOutOfVocab", "TokenizerError", "UnsupportedModel"]
