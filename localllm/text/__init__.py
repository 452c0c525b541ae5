"""Text: tokenizers built from GGUF metadata and sandboxed chat templates."""
