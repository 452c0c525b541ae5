"""Our own logits on the fixture passages, as per-position hashes of their float32 bits: the
reference that later changes to the engine (e.g. the KV cache's layout) must reproduce exactly.

Run with the project installed (no llama.cpp needed):
    python scripts/make_fixtures.py bits
"""

from __future__ import annotations

import hashlib
import json


def row_hashes(logits) -> list[str]:
    """First 16 hex digits of the sha256 of each row's float32 bytes."""
    return [hashlib.sha256(row.tobytes()).hexdigest()[:16] for row in logits]


def section_bits(args, model_path, write_json, fixtures) -> None:
    import localllm

    for name in ("smollm", "gemma"):
        fx = json.loads((fixtures / "logits" / f"{name}_logits.json").read_text())
        m = localllm.load(model_path(name), ctx_size=1024, threads=2)
        logits = m.logits(fx["ids"])
        write_json(fixtures / "logits" / f"{name}_bits.json", {
            "about": "sha256[:16] of each position's float32 logits over the passage's ids "
                     "(tests/fixtures/logits/<name>_logits.json), f16 KV cache",
            "rows": row_hashes(logits),
        })
