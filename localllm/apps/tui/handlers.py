"""What the chat's slash commands do: branches, edits, copies, settings, files, and the
choices offered when the context is full (commands.py parses them)."""

from __future__ import annotations

from typing import Callable

from textual.app import App

from . import commands as cmds
from .commands import COMMANDS, CommandError
from .composer import Composer
from .config import KEY_HELP
from .export import ExportError, read_file, write_file
from .replies import Replies
from .state import ChatState
from .store import StoreError
from .view import ConversationLog
from .widgets import code_blocks, speculation_figures

# Commands that make sense while a reply is being written.
_WHILE_WRITING = {"help", "stats", "copy", "save", "export", "quit"}


class Commands:
    """The slash commands, one ``cmd_NAME(args)`` each, and the moves they share with the
    keys: switching branches, copying. It changes the conversation through ChatState, shows
    results in the ConversationLog and starts replies through Replies."""

    def __init__(self, app: App, state: ChatState, view: ConversationLog, composer: Composer,
                 replies: Replies, keys: dict[str, str], on_status: Callable[[], None]):
        """Args:
            app: the running app (toasts, the clipboard, quitting).
            state: the conversation and its store.
            view: the conversation on screen.
            composer: the prompt box and the draft of the next message.
            replies: the engine side.
            keys: action -> keys in use (for /help).
            on_status: redraws the status bar after a change of state.
        """
        self.app, self.state, self.view, self.composer = app, state, view, composer
        self.replies, self.keys, self.on_status = replies, keys, on_status

    async def run(self, text: str) -> None:
        """Run a slash command; a mistake gets a one-line hint.

        Args:
            text: the prompt line, starting with one slash.
        """
        try:
            c = cmds.parse(text)
            if self.replies.generating and c.name not in _WHILE_WRITING:
                raise CommandError(f"/{c.name} waits for the reply: Esc stops it")
            handler = {
                "help": self.cmd_help, "clear": self.cmd_clear, "system": self.cmd_system,
                "regen": self.cmd_regen, "edit": self.cmd_edit, "branch": self.cmd_branch,
                "set": self.cmd_set, "save": self.cmd_save, "load": self.cmd_load,
                "export": self.cmd_export, "copy": self.cmd_copy, "drop": self.cmd_drop,
                "summary": self.cmd_summary, "stats": self.cmd_stats, "quit": self.cmd_quit,
            }[c.name]
            await handler(c.args)
        except (CommandError, ExportError, StoreError) as e:
            await self.view.note(str(e), error=True)
        except OSError as e:
            await self.view.note(f"error: {e.strerror or e}: {e.filename or ''}".rstrip(": "),
                                 error=True)

    async def cmd_help(self, args: str) -> None:
        width = max(len(u) for u, _ in COMMANDS.values())
        lines = [f"{u.ljust(width)}  {what}" for u, what in COMMANDS.values()]
        keys = self.keys
        kw = max(len(keys[a]) for a in KEY_HELP)
        lines += ["", "Keys (change them in [keys] of chat.toml):"]
        lines += [f"{keys[a].ljust(kw)}  {what}" for a, what in KEY_HELP.items()]
        lines += ["", "Copies go to the terminal's clipboard (OSC 52) and to a file; text can "
                  "also be selected with the mouse."]
        await self.view.note("\n".join(lines))

    async def cmd_clear(self, args: str) -> None:
        old = self.state.conv
        self.state.conv = self.state.new_conversation()
        self.state.conv.system, self.state.conv.settings = old.system, dict(old.settings)
        self.composer.draft.reset()
        await self.view.show(self.state.conv)
        saved = f" Conversation {old.id} is saved (llm chat --resume {old.id})." if old.id else ""
        await self.view.note(f"New conversation.{saved}")
        self.composer.restore_pending()
        self.replies.recount()

    async def cmd_system(self, args: str) -> None:
        conv = self.state.conv
        if not args:
            await self.view.note(f"System prompt: {conv.system}" if conv.system
                                 else "No system prompt. /system TEXT sets one.")
            return
        conv.system = "" if args == "off" else args
        self.composer.draft.cause = "system"
        self.state.store.save_state(conv)
        await self.view.note("System prompt removed." if args == "off" else
                             "System prompt set; it applies from the next reply.")
        self.replies.recount()

    async def cmd_regen(self, args: str) -> None:
        conv = self.state.conv
        head = conv.head()
        if head is None:
            raise CommandError("/regen: nothing to regenerate yet")
        await self.replies.regenerate(head if head.role == "user"
                                      else conv.messages[head.parent_id])

    async def cmd_edit(self, args: str) -> None:
        users = [m for m in self.state.conv.path() if m.role == "user"]
        if not users:
            raise CommandError("/edit: no message to edit yet")
        n = cmds.parse_index(args, "edit")
        if n is not None and n > len(users):
            raise CommandError(f"/edit: there are {len(users)} messages of yours on this branch")
        self.composer.start_edit(users[-1] if n is None else users[n - 1])
        self.on_status()

    async def cmd_branch(self, args: str) -> None:
        points = self.state.conv.branch_points()
        if not points:
            raise CommandError("/branch: no branches yet (/regen or /edit makes one)")
        choice = cmds.parse_index(args, "branch", allow=("next", "prev"))
        if choice is None:
            lines = [f"message {p.index + 1} ({'you' if p.message.role == 'user' else 'reply'}): "
                     f"branch {p.position} of {p.count}" for p in points]
            lines.append("/branch K switches the last one; Alt+Left/Right on a message "
                         "switches that one.")
            await self.view.note("\n".join(lines))
            return
        last = points[-1]
        if choice in ("next", "prev"):
            await self.branch_step(last.message.id, 1 if choice == "next" else -1)
            return
        if choice > last.count:
            raise CommandError(f"/branch: message {last.index + 1} has {last.count} branches")
        await self.switch_to(self.state.conv.siblings(last.message.id)[choice - 1])

    async def switch_to(self, msg_id: int) -> None:
        """Show the branch through a message, and save that choice."""
        conv = self.state.conv
        conv.select(msg_id)
        self.state.store.save_state(conv)
        self.composer.draft.cause = "branch"
        await self.view.show(conv)
        self.view.scroll_to_message(msg_id)
        self.replies.recount()

    async def branch_step(self, msg_id: int, delta: int) -> None:
        """Switch to the sibling ``delta`` places from a message (a toast at either end)."""
        sibs = self.state.conv.siblings(msg_id)
        i = sibs.index(msg_id) + delta
        if not 0 <= i < len(sibs):
            self.app.notify("No more branches that way.")
            return
        on_message = self.view.focused_message() is not None
        await self.switch_to(sibs[i])
        if on_message:   # the views were rebuilt: stay on the same message
            self.view.focus_message(sibs[i])

    async def cmd_set(self, args: str) -> None:
        if not args:
            s = self.state.sampling()
            names = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens",
                     "repeat_penalty")
            await self.view.note("  ".join(f"{n}={s.get(n)}" for n in names))
            return
        key, value = cmds.parse_set(args, self.state.sampling())
        self.state.conv.settings[key] = value
        self.state.store.save_state(self.state.conv)
        await self.view.note(f"{key} = {'random' if value is None else value}")

    async def cmd_save(self, args: str) -> None:
        if not args:
            raise CommandError(cmds.usage("save"))
        path = write_file(self.state.conv, args, markdown=False)
        await self.view.note(f"Saved every branch to {path}")

    async def cmd_export(self, args: str) -> None:
        if not args:
            raise CommandError(cmds.usage("export"))
        path = write_file(self.state.conv, args)
        what = "this branch as Markdown" if path.suffix.lower() in (".md", ".markdown") \
            else "every branch as JSON"
        await self.view.note(f"Exported {what} to {path}")

    async def cmd_load(self, args: str) -> None:
        if not args:
            raise CommandError(cmds.usage("load"))
        conv = self.state.conv = self.state.store.import_conversation(read_file(args))
        self.composer.draft.reset("load")
        await self.view.show(conv)
        await self.view.note(f"Loaded {args} as conversation {conv.id} "
                             f"({len(conv.messages)} messages).")
        self.replies.recount()

    async def cmd_copy(self, args: str) -> None:
        replies = [m for m in self.state.conv.path() if m.role == "assistant"]
        if not replies:
            raise CommandError("/copy: no reply to copy yet")
        words = args.split()
        if words and words[0].lower() == "code":
            blocks = code_blocks(replies[-1].content)
            if not blocks:
                raise CommandError("/copy code: the last reply has no code block")
            k = cmds.parse_index(" ".join(words[1:]), "copy")
            if k is not None and k > len(blocks):
                raise CommandError(f"/copy code: the last reply has {len(blocks)} code blocks")
            text = "\n".join(blocks) if k is None else blocks[k - 1]
            self.copy_text(text, "code" if k is None else f"code block {k}")
            return
        n = cmds.parse_index(args, "copy")
        if n is not None and n > len(replies):
            raise CommandError(f"/copy: there are {len(replies)} replies on this branch")
        self.copy_text(replies[-1 if n is None else n - 1].content, "the reply")

    def copy_text(self, text: str, what: str) -> None:
        """To the terminal's clipboard (OSC 52), and to a file for terminals without it."""
        self.app.copy_to_clipboard(text)
        path = self.state.options.clipboard
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            where = f"; also in {path}"
        except OSError as e:
            where = f"; could not write {path}: {e.strerror}"
        self.app.notify(f"Copied {what} ({len(text)} characters){where}")

    async def cmd_drop(self, args: str) -> None:
        a = args.strip()
        if not a.isdigit():
            raise CommandError(cmds.usage("drop"))
        n = int(a)
        path = self.state.conv.path()
        turns = sum(1 for m in path if m.role == "user")
        if n >= turns and n > 0:
            raise CommandError(f"/drop: this branch has {turns} turns; keep at least the last")
        seen = 0
        for m in path:
            seen += m.role == "user"
            dropped = seen <= n
            if bool(m.meta.get("dropped")) != dropped:
                self.state.store.set_meta(self.state.conv, m, dropped=dropped)
        self.composer.draft.cause = "drop"
        await self.view.show(self.state.conv)
        await self.view.note(f"The oldest {n} turns are left out of the context (still saved)."
                             if n else "Every turn is in the context again.")
        self.composer.restore_pending()
        self.replies.recount()

    async def cmd_summary(self, args: str) -> None:
        if not self.state.conv.path():
            raise CommandError("/summary: nothing to summarize yet")
        await self.replies.summarize()

    async def cmd_stats(self, args: str) -> None:
        lines = []
        if self.replies.chat_model is not None:
            i = self.replies.chat_model.info
            lines.append(f"model: {i.name} {i.quant} · {i.placement} · context {i.ctx} · "
                         f"loaded in {i.load_seconds:.2f} s")
        if self.replies.usage is not None:
            u = self.replies.usage
            lines.append(f"context: {u.used}/{u.limit} tokens · KV {u.kv_bytes / 2**20:.2f} of "
                         f"{u.kv_limit_bytes / 2**20:.1f} MiB ({u.kv_type})")
        s = self.replies.last_stats
        if s is not None:
            lines.append(f"last reply: prompt {s.prompt_tokens} tokens, {s.cached_tokens} reused, "
                         f"{s.prompt_tps:.1f} tok/s · {s.generated_tokens} tokens at "
                         f"{s.generate_tps:.1f} tok/s · first token after "
                         f"{s.time_to_first_token:.2f} s · {s.finish_reason} · seed {s.seed}")
            if s.draft_tokens:
                lines.append(f"speculation: {speculation_figures(s)} "
                             f"({s.accepted_tokens} of {s.draft_tokens} drafted tokens)")
            if s.reuse_note:
                lines.append(f"recomputed: {s.reuse_note}")
        c = self.state.conv
        lines.append(f"conversation {c.id or '(not saved yet)'}: {len(c.messages)} messages, "
                     f"{len(c.branch_points())} branch points on this branch")
        await self.view.note("\n".join(lines))

    async def cmd_quit(self, args: str) -> None:
        self.replies.stop_reply()
        self.app.exit()

