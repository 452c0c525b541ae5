"""The front ends: `llm` (cli), `llm serve` (server/) and `llm chat` (tui/)."""
