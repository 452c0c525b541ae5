#!/usr/bin/env python3
"""Write the README's two SVG screenshots of `llm chat` with the real SmolLM2 model: a
two-turn chat (docs/chat.svg) and the branch view after /regen (docs/chat-branches.svg)."""

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

import localllm
from localllm.apps.tui.app import ChatApp, ChatOptions
from localllm.apps.tui.pilot import say as pilot_say
from localllm.apps.tui.pilot import until

TURNS = ["Write a Python function that adds two numbers.",
         "Now say in one sentence what it does."]


async def say(pilot, text):
    await pilot_say(pilot, text, timeout=600.0)
    await pilot.pause(0.5)   # let the last Markdown update render


async def shoot(app, out: Path, size):
    async with app.run_test(size=size) as pilot:
        await until(pilot, lambda: app.chat_model is not None)
        for text in TURNS:
            await say(pilot, text)
        app.save_screenshot(str(out / "chat.svg"))
        await say(pilot, "/set temp 0.9")
        await say(pilot, "/set seed 5")
        await say(pilot, "/regen")
        await say(pilot, "/branch")
        app.save_screenshot(str(out / "chat-branches.svg"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "docs"))
    ap.add_argument("--size", default="100x36", help="terminal COLSxROWS")
    args = ap.parse_args(argv)
    cols, rows = (int(v) for v in args.size.split("x"))
    model = localllm.load(args.model, ctx_size=2048)
    with tempfile.TemporaryDirectory() as tmp:
        app = ChatApp(ChatOptions(
            load=lambda: model, model_label=args.model, database=Path(tmp) / "chat.db",
            clipboard=Path(tmp) / "clipboard.txt",
            sampling=dict(temperature=0.0, top_k=40, top_p=0.95, min_p=0.05,
                          repeat_penalty=1.0, seed=None, max_tokens=96)))
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        asyncio.run(shoot(app, out, (cols, rows)))
    print(f"wrote {out / 'chat.svg'} and {out / 'chat-branches.svg'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
