"""Tool calls out of streamed output: the text that is no call as it comes, the calls once
they are complete (StreamSplitter), for the server's streams and Model.chat."""

from __future__ import annotations

from localllm.text.tool_calls import ToolCall

from .tool_use import ToolPlan, harmony_calls


class StreamSplitter:
    """Streams a choice's content while holding back what may start a tool call; the calls
    come out when the choice ends."""

    def __init__(self, plan_: ToolPlan):
        self.plan = plan_
        self.text = ""
        self.sent = 0
        self.held = plan_.buffers
        self.parts: list = []   # harmony calls the reasoning split took out of the text

    def feed(self, piece: str, parts=()) -> str:
        """The content that can be shown now.

        Args:
            piece: the next content text.
            parts: harmony "tool_call" Parts that came with it (see ToolPlan.split).
        """
        self.parts += [p for p in parts if p.kind == "tool_call"]
        self.text += piece
        if self.held or self.plan.fmt is None:
            if self.plan.fmt is None:
                out, self.sent = self.text[self.sent:], len(self.text)
                return out
            return ""
        trig = self.plan.fmt.trigger
        at = self.text.find(trig, self.sent)
        if at >= 0:
            self.held = True
            out, self.sent = self.text[self.sent:at], at
            return out
        keep = 0   # a tail that may be the trigger's start
        for k in range(min(len(trig) - 1, len(self.text) - self.sent), 0, -1):
            if self.text.endswith(trig[:k]):
                keep = k
                break
        end = len(self.text) - keep
        out, self.sent = self.text[self.sent:end], end
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not yet shown, calls) at the choice's end."""
        content, calls = self.plan.split(self.text)
        calls = calls + harmony_calls(self.parts) if self.plan.fmt is not None else calls
        if calls:
            shown = self.text[:self.sent]
            rest = content[len(shown.strip()):] if content.startswith(shown.strip()) else ""
            return rest.strip() if not shown else rest, calls
        return self.text[self.sent:] if not self.plan.buffers else content, calls


def stream_calls(chunks, plan_: ToolPlan):
    """A generation's pieces with its tool calls split off: the text that is no call as it
    comes, then each ToolCall once the generation ends.

    Args:
        chunks: an iterable of text pieces (a Generation; closed when this ends).
        plan_: the ToolPlan the prompt was made with.
    Returns:
        an iterator of str pieces and ToolCall objects.
    """
    split = StreamSplitter(plan_)
    try:
        for c in chunks:
            shown = split.feed(str(c))
            if shown:
                yield c if shown == str(c) else shown
        rest, calls = split.finish()
        if rest:
            yield rest
        yield from calls
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()
