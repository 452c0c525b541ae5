"""What the chat's commands and keys do: branches, edits, copies, settings, files, and the
choices offered when the context is full. A mixin of ChatApp."""

from __future__ import annotations

import time

from . import commands as cmds
from .commands import COMMANDS, CommandError
from .config import KEY_HELP
from .events import ReplyRequest, SummaryDone
from .export import ExportError, read_file, write_file
from .store import StoreError
from .tree import Message
from .widgets import MessageView, code_blocks, speculation_figures

# Commands that make sense while a reply is being written.
_WHILE_WRITING = {"help", "stats", "copy", "save", "export", "quit"}
SUMMARY_REQUEST = ("Summarize our conversation so far in one short paragraph: the facts, "
                   "decisions and open questions someone needs to continue it.")
SUMMARY_TOKENS = 256


class ChatCommands:
    """Command and key handlers; ChatApp provides the state (conv, store, views, engine)."""

    # ---- commands ---------------------------------------------------------------------

    @staticmethod
    def is_command(text: str) -> bool:
        return cmds.is_command(text)

    async def run_command(self, text: str) -> None:
        """Run a slash command; a mistake gets a one-line hint."""
        try:
            c = cmds.parse(text)
            if self.generating and c.name not in _WHILE_WRITING:
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
            await self.note(str(e), error=True)
        except OSError as e:
            await self.note(f"error: {e.strerror or e}: {e.filename or ''}".rstrip(": "),
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
        await self.note("\n".join(lines))

    async def cmd_clear(self, args: str) -> None:
        old = self.conv
        self.conv = self.new_conversation()
        self.conv.system, self.conv.settings = old.system, dict(old.settings)
        self.editing, self.new_root, self.cause = None, False, ""
        await self.show_conversation()
        saved = f" Conversation {old.id} is saved (llm chat --resume {old.id})." if old.id else ""
        await self.note(f"New conversation.{saved}")
        self.restore_pending()
        self.recount()

    async def cmd_system(self, args: str) -> None:
        if not args:
            await self.note(f"System prompt: {self.conv.system}" if self.conv.system
                            else "No system prompt. /system TEXT sets one.")
            return
        self.conv.system = "" if args == "off" else args
        self.cause = "system"
        self.store.save_state(self.conv)
        await self.note("System prompt removed." if args == "off" else
                        "System prompt set; it applies from the next reply.")
        self.recount()

    async def cmd_regen(self, args: str) -> None:
        head = self.conv.head()
        if head is None:
            raise CommandError("/regen: nothing to regenerate yet")
        await self.regenerate(head if head.role == "user" else self.conv.messages[head.parent_id])

    async def regenerate(self, user_msg: Message) -> None:
        """A new reply to ``user_msg``, as a sibling of any it has."""
        if not self.can_generate():
            return
        self.conv.select(user_msg.id)
        self.start_reply(ReplyRequest(self.conv.prompt(self.path_to(user_msg.id)),
                                      self.sampling(), self.cause or "regen", None,
                                      user_msg.id))

    async def cmd_edit(self, args: str) -> None:
        users = [m for m in self.conv.path() if m.role == "user"]
        if not users:
            raise CommandError("/edit: no message to edit yet")
        n = cmds.parse_index(args, "edit")
        if n is not None and n > len(users):
            raise CommandError(f"/edit: there are {len(users)} messages of yours on this branch")
        self.start_edit(users[-1] if n is None else users[n - 1])

    def start_edit(self, msg: Message) -> None:
        self.editing, self.new_root = msg, False
        self.prompt_box.set_text(msg.content)
        self.prompt_box.focus()
        self.update_status()

    async def cmd_branch(self, args: str) -> None:
        points = self.conv.branch_points()
        if not points:
            raise CommandError("/branch: no branches yet (/regen or /edit makes one)")
        choice = cmds.parse_index(args, "branch", allow=("next", "prev"))
        if choice is None:
            lines = [f"message {p.index + 1} ({'you' if p.message.role == 'user' else 'reply'}): "
                     f"branch {p.position} of {p.count}" for p in points]
            lines.append("/branch K switches the last one; Alt+Left/Right on a message "
                         "switches that one.")
            await self.note("\n".join(lines))
            return
        last = points[-1]
        if choice in ("next", "prev"):
            await self.branch_step(last.message.id, 1 if choice == "next" else -1)
            return
        if choice > last.count:
            raise CommandError(f"/branch: message {last.index + 1} has {last.count} branches")
        await self.switch_to(self.conv.siblings(last.message.id)[choice - 1])

    async def switch_to(self, msg_id: int) -> None:
        self.conv.select(msg_id)
        self.store.save_state(self.conv)
        self.cause = "branch"
        await self.show_conversation()
        for v in self.message_views():
            if v.message is not None and v.message.id == msg_id:
                v.scroll_visible(animate=False)
        self.recount()

    async def branch_step(self, msg_id: int, delta: int) -> None:
        sibs = self.conv.siblings(msg_id)
        i = sibs.index(msg_id) + delta
        if not 0 <= i < len(sibs):
            self.notify("No more branches that way.")
            return
        on_message = self.focused_message() is not None
        await self.switch_to(sibs[i])
        if on_message:   # the views were rebuilt: stay on the same message
            self.focus_message(sibs[i])

    async def cmd_set(self, args: str) -> None:
        if not args:
            s = self.sampling()
            names = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens",
                     "repeat_penalty")
            await self.note("  ".join(f"{n}={s.get(n)}" for n in names))
            return
        key, value = cmds.parse_set(args, self.sampling())
        self.conv.settings[key] = value
        self.store.save_state(self.conv)
        await self.note(f"{key} = {'random' if value is None else value}")

    async def cmd_save(self, args: str) -> None:
        if not args:
            raise CommandError(cmds.usage("save"))
        path = write_file(self.conv, args, markdown=False)
        await self.note(f"Saved every branch to {path}")

    async def cmd_export(self, args: str) -> None:
        if not args:
            raise CommandError(cmds.usage("export"))
        path = write_file(self.conv, args)
        what = "this branch as Markdown" if path.suffix.lower() in (".md", ".markdown") \
            else "every branch as JSON"
        await self.note(f"Exported {what} to {path}")

    async def cmd_load(self, args: str) -> None:
        if not args:
            raise CommandError(cmds.usage("load"))
        self.conv = self.store.import_conversation(read_file(args))
        self.editing, self.new_root, self.cause = None, False, "load"
        await self.show_conversation()
        await self.note(f"Loaded {args} as conversation {self.conv.id} "
                        f"({len(self.conv.messages)} messages).")
        self.recount()

    async def cmd_copy(self, args: str) -> None:
        replies = [m for m in self.conv.path() if m.role == "assistant"]
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
        self.copy_to_clipboard(text)
        path = self.options.clipboard
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            where = f"; also in {path}"
        except OSError as e:
            where = f"; could not write {path}: {e.strerror}"
        self.notify(f"Copied {what} ({len(text)} characters){where}")

    async def cmd_drop(self, args: str) -> None:
        a = args.strip()
        if not a.isdigit():
            raise CommandError(cmds.usage("drop"))
        n = int(a)
        path = self.conv.path()
        turns = sum(1 for m in path if m.role == "user")
        if n >= turns and n > 0:
            raise CommandError(f"/drop: this branch has {turns} turns; keep at least the last")
        seen = 0
        for m in path:
            seen += m.role == "user"
            dropped = seen <= n
            if bool(m.meta.get("dropped")) != dropped:
                self.store.set_meta(self.conv, m, dropped=dropped)
        self.cause = "drop"
        await self.show_conversation()
        await self.note(f"The oldest {n} turns are left out of the context (still saved)."
                        if n else "Every turn is in the context again.")
        self.restore_pending()
        self.recount()

    def restore_pending(self) -> None:
        if self.pending_text and not self.prompt_box.text.strip():
            self.prompt_box.set_text(self.pending_text)
        self.pending_text = ""

    async def cmd_summary(self, args: str) -> None:
        if not self.conv.path():
            raise CommandError("/summary: nothing to summarize yet")
        if not self.can_generate():
            return
        cm, messages = self.chat_model, self.conv.prompt()
        sampling = self.sampling()
        limit = sampling.get("max_tokens", -1)   # the user's reply limit bounds it too
        sampling["max_tokens"] = SUMMARY_TOKENS if limit < 0 else min(limit, SUMMARY_TOKENS)
        self.generating = True
        self.cancel.clear()
        await self.note("Summarizing this branch…", key="summary")

        def job():
            system = messages[:1] if messages and messages[0]["role"] == "system" else []
            turns = messages[len(system):]
            ask = [{"role": "user", "content": SUMMARY_REQUEST}]
            while turns and cm.count(system + turns + ask) + sampling["max_tokens"] > cm.info.ctx:
                turns = turns[2:]   # the oldest turns that no longer fit
            reply = cm.reply(system + turns + ask, sampling, self.cancel,
                             lambda text, n, usage: None, "summary")
            self.post_message(SummaryDone(reply.text.strip()))
        self.engine.submit(job)

    async def on_summary_done(self, event: SummaryDone) -> None:
        self.generating = False
        await self.remove_note("summary")
        pending = self.pending_text
        self.pending_text = ""
        self.new_root, self.editing = True, None
        self.prompt_box.set_text(f"Summary of our conversation so far:\n\n{event.text}\n\n{pending}")
        self.prompt_box.focus()
        await self.note("The summary is in the box: edit it, add your message, and Enter "
                        "starts a new branch from it (the old one stays: /branch).")
        self.update_status()

    async def cmd_stats(self, args: str) -> None:
        lines = []
        if self.chat_model is not None:
            i = self.chat_model.info
            lines.append(f"model: {i.name} {i.quant} · {i.placement} · context {i.ctx} · "
                         f"loaded in {i.load_seconds:.2f} s")
        if self.usage is not None:
            u = self.usage
            lines.append(f"context: {u.used}/{u.limit} tokens · KV {u.kv_bytes / 2**20:.2f} of "
                         f"{u.kv_limit_bytes / 2**20:.1f} MiB ({u.kv_type})")
        s = self.last_stats
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
        c = self.conv
        lines.append(f"conversation {c.id or '(not saved yet)'}: {len(c.messages)} messages, "
                     f"{len(c.branch_points())} branch points on this branch")
        await self.note("\n".join(lines))

    async def cmd_quit(self, args: str) -> None:
        self.cancel.set()
        self.exit()

    # ---- keys -------------------------------------------------------------------------

    async def action_stop(self) -> None:
        if self.generating:
            self.cancel.set()
        elif self.editing is not None or self.new_root:
            self.editing, self.new_root = None, False
            self.prompt_box.set_text("")
            self.update_status()
        else:
            self.prompt_box.focus()

    async def action_interrupt(self) -> None:
        now = time.monotonic()
        if now - self._last_interrupt < 2.0:
            await self.cmd_quit("")
            return
        self._last_interrupt = now
        if self.generating:
            self.cancel.set()
        self.notify("Ctrl+C again to quit (or Ctrl+Q).")

    def focused_message(self) -> MessageView | None:
        return self.focused if isinstance(self.focused, MessageView) else None

    async def action_branch(self, delta: int) -> None:
        if self.generating:
            return
        view = self.focused_message()
        if view is not None and view.message is not None:
            await self.branch_step(view.message.id, delta)
            return
        points = self.conv.branch_points()
        if points:
            await self.branch_step(points[-1].message.id, delta)

    async def action_branch_step(self, msg_id: int, delta: int) -> None:
        if not self.generating and msg_id in self.conv.messages:
            await self.branch_step(msg_id, delta)

    def focus_message(self, msg_id: int) -> None:
        for v in self.message_views():
            if v.message is not None and v.message.id == msg_id:
                v.focus()

    def action_move_focus(self, delta: int) -> None:
        views = self.message_views()
        if not views:
            return
        cur = self.focused_message()
        i = views.index(cur) + delta if cur in views else (len(views) - 1 if delta < 0 else None)
        if i is None or i >= len(views):
            self.prompt_box.focus()
        else:
            views[max(i, 0)].focus()
            views[max(i, 0)].scroll_visible(animate=False)

    async def action_help(self) -> None:
        await self.cmd_help("")

    def action_copy_message(self) -> None:
        view = self.focused_message()
        if view is not None:
            self.copy_text(view.text, "the message")

    def action_copy_code(self) -> None:
        view = self.focused_message()
        if view is not None:
            blocks = code_blocks(view.text)
            if blocks:
                self.copy_text("\n".join(blocks), "the code")
            else:
                self.notify("This message has no code block.")

    def action_edit_message(self) -> None:
        view = self.focused_message()
        if view is not None and view.message is not None and view.role == "user" \
                and not self.generating:
            self.start_edit(view.message)

    async def action_regen_message(self) -> None:
        view = self.focused_message()
        if view is not None and view.message is not None and view.role == "assistant":
            await self.regenerate(self.conv.messages[view.message.parent_id])
