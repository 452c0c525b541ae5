"""Helpers the tests share that nothing outside tests/ needs (the hostile GGUF corpus, the
fuzzer and its checker process)."""
