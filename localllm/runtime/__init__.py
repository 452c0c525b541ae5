"""The runtime: placement and the memory ledger, KV blocks and page tables, sequences and
the Runner's forward step, start-up warming."""
