"""Generation: sampling, the Decoder, speculative decoding, batching, constraints, perplexity."""
