"""``tokenloom chat``: an interactive conversation, with tool calls when given --tools FILE.json.

Lines are read with line editing and a history kept across sessions (readline, on a terminal).
Ctrl-C stops the reply being written and keeps the conversation (what was said stays in it);
Ctrl-D or /exit quits. Slash commands are the REPL's own, never sent to the model (/help).
A message of several lines is one turn: between lines starting and ending with \"\"\" (as in ollama),
or pasted on a terminal (bracketed paste: the terminal marks where a paste starts and ends).
With tools, the model may answer with calls (kept valid by the same grammar the server uses);
each is shown, and what you type back is the tool's result, after which the model goes on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import sys
from pathlib import Path
from typing import Any

from tokenloom.entrypoints.cli.common import GenerationSummary
from tokenloom.entrypoints.server.chat_tools import ChatFeatures, ReplyStream, make_turn, read_reply, tool_constraint

HELP = """tokenloom chat: type a message and press Enter. Ctrl-C stops a reply; Ctrl-D or /exit quits.
  /help           this list
  /reset          clear the conversation (the system prompt stays)
  /system TEXT    set the system prompt (/system alone removes it)
  /save FILE      save the conversation as JSON
  /load FILE      continue a conversation saved with /save
  /exit           quit
  \"\"\"             start a message of several lines; a line ending with \"\"\" sends it
                  (a paste is one message too)"""

PASTE_ON, PASTE_OFF = "\x1b[?2004h", "\x1b[?2004l"  # the terminal's bracketed paste mode
PASTE_START, PASTE_END = "\x1b[200~", "\x1b[201~"  # around pasted text, once the mode is on
QUOTES = '"""'
MORE = "... "  # the prompt for a message's next line


class ChatSession:
    """The conversation and how one turn is generated (with the tools' grammar, if any)."""

    def __init__(self, llm, params, system: str | None, functions: list[dict[str, Any]] | None) -> None:
        self.llm, self.functions = llm, functions or []
        self.mode = "auto" if functions else "none"
        self.features = ChatFeatures.for_template(llm.tokenizer.chat_template)
        self.system = system
        self.history: list[dict] = self._start()
        self.params = params
        if functions:  # the server's grammar for tool_choice auto, and its decoding of markers
            grammar = tool_constraint(self.mode, self.functions, self.features, llm.engine, parallel=True)
            self.params = dataclasses.replace(params, structured_output=grammar)
        if (functions or self.features.reasoning) and self.features.decode_with_markers(llm.tokenizer):
            self.params = dataclasses.replace(self.params, skip_special_tokens=False)

    def _start(self) -> list[dict]:
        return [{"role": "system", "content": self.system}] if self.system else []

    def reset(self) -> None:
        self.history = self._start()

    def set_system(self, text: str | None) -> None:
        """Replace the system prompt; the rest of the conversation stays."""
        rest = [m for m in self.history if m["role"] != "system"]
        self.system = text or None
        self.history = self._start() + rest

    def save(self, path: str) -> int:
        """Write the conversation as JSON; how many messages."""
        Path(path).write_text(json.dumps({"messages": self.history}, indent=1, ensure_ascii=False))
        return len(self.history)

    def load(self, path: str) -> int:
        """Continue a conversation /save wrote; ValueError naming what is wrong."""
        try:
            messages = json.loads(Path(path).read_text())["messages"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"cannot load {path!r}: {e}") from None
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError(f"cannot load {path!r}: 'messages' is not a list of messages")
        self.history = messages
        system = next((m for m in messages if m["role"] == "system"), None)
        self.system = system["content"] if system else None
        return len(messages)

    def reply(self, out=None, stopped=lambda: False) -> list[dict]:
        """Generate the assistant's turn, printing it (to `out`, default stdout) as it streams,
        then its speed on stderr; the turn stays in the conversation, cut short where `stopped()`
        became true. Its tool calls (OpenAI shape)."""
        out = out or sys.stdout
        prompt, ids = self._fitted_prompt()
        reader, summary = ReplyStream(prompt, self.mode, self.features, self.functions), GenerationSummary(len(ids))
        text, cut = [], False
        params = dataclasses.replace(self.params, context_keep=self._system_tokens(ids))
        with contextlib.closing(self.llm.stream_deltas(ids, params)) as deltas:
            for delta in deltas:
                stop = stopped()
                text.append(delta.text_delta)
                summary.add(len(delta.new_token_ids))
                cut = delta.finish_reason == "length" or stop
                said = reader.feed(delta.text_delta, delta.finished or cut, cut)
                print(said.get("reasoning_content", "") + said.get("content", ""), end="", file=out, flush=True)
                if stop:
                    break
        reply = read_reply("".join(text), prompt, self.mode, self.features, cut, self.functions)
        self.history.append({"role": "assistant", "content": reply.content or "", "tool_calls": reply.tool_calls})
        for call in reply.tool_calls:
            print(f"\n-> {call['function']['name']}({call['function']['arguments']})", file=out)
        print(file=out)
        print(f"[{'stopped; ' if stopped() else ''}{summary}]", file=sys.stderr)
        return reply.tool_calls

    def _render(self, messages: list[dict], generation_prompt: bool = True) -> tuple[str, list[int]]:
        turn = make_turn(messages, self.mode, self.functions, self.features)
        prompt = self.llm.tokenizer.apply_chat_template(
            turn.messages, add_generation_prompt=generation_prompt, tools=turn.template_tools
        )
        return prompt, self.llm.tokenizer.encode(prompt, add_special_tokens=False)

    def _fitted_prompt(self) -> tuple[str, list[int]]:
        """The conversation's prompt (text, ids), its oldest turns after the system prompt dropped
        (said on stderr) until it leaves a quarter of the context for the reply."""
        prompt, ids = self._render(self.history)
        room = self.llm.engine.max_model_len * 3 // 4
        dropped = 0
        while len(ids) > room and sum(m["role"] != "system" for m in self.history) > 1:
            first = next(i for i, m in enumerate(self.history) if m["role"] != "system")
            del self.history[first]  # a whole turn: up to the next user message
            while first < len(self.history) - 1 and self.history[first]["role"] not in ("user", "system"):
                del self.history[first]
            dropped += 1
            prompt, ids = self._render(self.history)
        if dropped:
            print(f"[the oldest {dropped} turn(s) left the context]", file=sys.stderr)
        return prompt, ids

    def _system_tokens(self, ids: list[int]) -> int | None:
        """How many of the prompt's first tokens hold the system prompt (what context shift keeps);
        None (the engine's keep) without one, or where it is over half the context."""
        system = [m for m in self.history if m["role"] == "system"]
        if not system:
            return None
        head = self._render(system, generation_prompt=False)[1]
        common = next((i for i, (a, b) in enumerate(zip(head, ids)) if a != b), min(len(head), len(ids)))
        return common if 0 < common <= self.llm.engine.max_model_len // 2 else None

    def add_result(self, call: dict, result: str) -> None:
        self.history.append(
            {"role": "tool", "tool_call_id": call["id"], "name": call["function"]["name"], "content": result}
        )


class StopOnCtrlC:
    """``with StopOnCtrlC() as stop:`` Ctrl-C sets ``stop()`` instead of raising, so a reply ends
    at its next token and the engine is never interrupted mid-step."""

    def __init__(self) -> None:
        self.hit, self.installed = False, False

    def __call__(self) -> bool:
        return self.hit

    def __enter__(self) -> StopOnCtrlC:
        try:
            self.previous = signal.signal(signal.SIGINT, self._on_sigint)
            self.installed = True
        except ValueError:  # not the main thread: Ctrl-C cannot reach us here anyway
            pass
        return self

    def _on_sigint(self, signum, frame) -> None:
        self.hit = True

    def __exit__(self, *exc) -> None:
        if self.installed:  # previous is None where it was not set from Python: the default then
            signal.signal(signal.SIGINT, self.previous if self.previous is not None else signal.SIG_DFL)


def _command(session: ChatSession, line: str) -> bool:
    """Carry out a slash command; False for /exit."""
    name, _, arg = line.strip().partition(" ")
    arg = arg.strip()
    if name in ("/exit", "/quit", "/bye"):
        return False
    try:
        if name == "/help":
            print(HELP, file=sys.stderr)
        elif name == "/reset":
            session.reset()
            print("conversation cleared" + (" (the system prompt stays)" if session.system else ""), file=sys.stderr)
        elif name == "/system":
            session.set_system(arg)
            print(f"system prompt {'set' if arg else 'removed'}", file=sys.stderr)
        elif name in ("/save", "/load") and not arg:
            print(f"{name} needs a file name, e.g. {name} chat.json", file=sys.stderr)
        elif name == "/save":
            print(f"saved {session.save(arg)} messages to {arg}", file=sys.stderr)
        elif name == "/load":
            print(f"loaded {session.load(arg)} messages from {arg}", file=sys.stderr)
        else:
            print(f"unknown command {name}; /help lists them", file=sys.stderr)
    except (OSError, ValueError) as e:
        print(f"{name}: {e}", file=sys.stderr)
    return True


def _turn(session: ChatSession, read) -> bool:
    """Generate replies, reading each tool call's result, until the model answers; False on Ctrl-D."""
    with StopOnCtrlC() as stop:
        calls = session.reply(stopped=stop)
    while calls and not stop():
        for call in calls:
            try:
                session.add_result(call, read_message(read, f"result of {call['function']['name']}> ")[0])
            except EOFError:
                return False
            except KeyboardInterrupt:
                print(file=sys.stderr)
                return True
        with StopOnCtrlC() as stop:
            calls = session.reply(stopped=stop)
    return True


def _unpaste(read, line: str) -> str:
    """`line` with any bracketed paste in it completed: while a paste is open (a start marker
    without its end), the next lines are read and joined with newlines; the markers are removed."""
    lines = [line]
    while "".join(lines).count(PASTE_START) > "".join(lines).count(PASTE_END):
        lines.append(read(MORE))
    return "\n".join(lines).replace(PASTE_START, "").replace(PASTE_END, "")


def _read_block(read, first: str) -> str:
    """The message of a \"\"\" block opened by `first`: its lines up to the first one ending with
    \"\"\" (which may be `first`), newlines kept, the quotes and blank opening/closing lines left out.
    Ctrl-D inside the block raises EOFError (the block is not sent)."""
    lines = [first.strip()[len(QUOTES) :]]
    try:
        while not lines[-1].rstrip().endswith(QUOTES):
            lines.append(_unpaste(read, read(MORE)))
    except EOFError:
        print(f"\n(the unfinished {QUOTES} message was not sent)", file=sys.stderr)
        raise
    lines[-1] = lines[-1].rstrip()[: -len(QUOTES)]
    return "\n".join(lines).strip("\n")


def read_message(read, prompt: str) -> tuple[str, bool]:
    """One message from `read`: a line, a bracketed paste (possibly over several lines) or a
    \"\"\" block; with True where it was a paste or a block, whose text is never a command (nor is
    a line with newlines in it: readline returns a paste so). EOFError and KeyboardInterrupt from
    `read` propagate."""
    line = read(prompt)
    if PASTE_START in line:
        return _unpaste(read, line), True
    if line.lstrip().startswith(QUOTES):
        return _read_block(read, line), True
    return line, "\n" in line


@contextlib.contextmanager
def bracketed_paste():
    """While the block runs, where stdin and stdout are a terminal, have it mark pasted text
    (PASTE_START ... PASTE_END) so that a paste of several lines is one message; the mode is
    turned off again however the block ends. Elsewhere (piped input) nothing is written."""
    on = sys.stdin.isatty() and sys.stdout.isatty()
    if on:
        print(PASTE_ON, end="", flush=True)
    try:
        yield
    finally:
        if on:
            print(PASTE_OFF, end="", flush=True)


def chat_loop(session: ChatSession, read=input) -> int:
    """Read messages until /exit or end of input (Ctrl-D); after tool calls, read each call's result.
    A \"\"\" block, or a paste on a terminal, is one message however many lines it has."""
    print(HELP.splitlines()[0], "/help lists the commands.", file=sys.stderr)
    with bracketed_paste():
        return _loop(session, read)


def _loop(session: ChatSession, read) -> int:
    """chat_loop's turns: 0 at /exit or end of input."""
    while True:
        try:
            text, whole = read_message(read, "> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:
            print("\n(Ctrl-D or /exit quits)", file=sys.stderr)
            continue
        if not whole and text.strip().startswith("/"):
            if not _command(session, text):
                return 0
            continue
        if not text.strip():
            continue
        session.history.append({"role": "user", "content": text})
        if not _turn(session, read):
            return 0


def line_editing(history_file: Path) -> None:
    """Arrow keys, editing and a history kept in `history_file` for input(), where stdin is a terminal."""
    if not sys.stdin.isatty():
        return
    try:
        import atexit
        import readline
    except ImportError:  # a Python without readline: plain input()
        return
    with contextlib.suppress(OSError):
        readline.read_history_file(history_file)
    readline.set_history_length(1000)

    def save() -> None:
        with contextlib.suppress(OSError):
            history_file.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(history_file)

    atexit.register(save)
