"""`llm serve`: a local OpenAI-compatible endpoint (chat completions, completions, responses,
tokenize, health and metrics), safe by default. Needs the ``server`` extra."""

from .run import serve
from .settings import ServerSettings

__all__ = ["serve", "ServerSettings"]
