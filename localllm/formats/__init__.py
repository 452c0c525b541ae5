"""GGUF files: the hardened reader, the quant-format table and reference dequantizers,
fetching models, inspect."""
