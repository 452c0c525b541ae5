"""What the tests and scripts/ share: synthetic GGUF models and quantized weights, small
tokenizer models, requantized copies, a real `llm serve` process, fault injection, texts."""
