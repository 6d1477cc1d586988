"""``tokenloom chat``: an interactive conversation, with tool calls when given --tools FILE.json.

With tools, the model may answer with calls (kept valid by the same grammar the server uses);
each is shown, and what you type back is the tool's result, after which the model goes on.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from tokenloom.server.chat_tools import ChatFeatures, ReplyStream, make_turn, read_reply, tool_constraint

HELP = "tokenloom chat: type a message; /reset clears the conversation, /exit or Ctrl-D quits."


class ChatSession:
    """The conversation and how one turn is generated (with the tools' grammar, if any)."""

    def __init__(self, llm, params, system: str | None, functions: list[dict[str, Any]] | None) -> None:
        self.llm, self.functions = llm, functions or []
        self.mode = "auto" if functions else "none"
        self.features = ChatFeatures.for_template(llm.tokenizer.chat_template)
        self.start = [{"role": "system", "content": system}] if system else []
        self.history = list(self.start)
        self.params = params
        if functions:          # the server's grammar for tool_choice auto, and its decoding of markers
            grammar = tool_constraint(self.mode, self.functions, self.features, llm.engine, parallel=True)
            self.params = dataclasses.replace(params, structured_output=grammar)
        if (functions or self.features.reasoning) and self.features.markers_dropped(llm.tokenizer):
            self.params = dataclasses.replace(self.params, skip_special_tokens=False)

    def reply(self, out=None) -> list[dict]:
        """Generate the assistant's turn, printing it (to `out`, default stdout) as it streams; its
        tool calls (OpenAI shape)."""
        out = out or sys.stdout
        turn = make_turn(self.history, self.mode, self.functions, self.features)
        prompt = self.llm.tokenizer.apply_chat_template(turn.messages, tools=turn.template_tools)
        reader, text, cut = ReplyStream(prompt, self.mode, self.features), [], False
        for delta in self.llm.stream_deltas(self.llm.tokenizer.encode(prompt, add_special_tokens=False),
                                            self.params):
            text.append(delta.text_delta)
            cut = delta.finish_reason == "length"
            said = reader.feed(delta.text_delta, delta.finished, cut)
            print(said.get("reasoning_content", "") + said.get("content", ""), end="", file=out, flush=True)
        reply = read_reply("".join(text), prompt, self.mode, self.features, cut)
        self.history.append({"role": "assistant", "content": reply.content or "", "tool_calls": reply.tool_calls})
        for call in reply.tool_calls:
            print(f"\n-> {call['function']['name']}({call['function']['arguments']})", file=out)
        print(file=out)
        return reply.tool_calls

    def add_result(self, call: dict, result: str) -> None:
        self.history.append({"role": "tool", "tool_call_id": call["id"], "name": call["function"]["name"],
                             "content": result})


def chat_loop(session: ChatSession, read=input) -> int:
    """Read lines until /exit or end of input; after tool calls, read each call's result."""
    print(HELP, file=sys.stderr)
    while True:
        try:
            line = read("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            session.history = list(session.start)
            continue
        if not line.strip():
            continue
        session.history.append({"role": "user", "content": line})
        calls = session.reply()
        while calls:
            for call in calls:
                try:
                    session.add_result(call, read(f"result of {call['function']['name']}> "))
                except (EOFError, KeyboardInterrupt):
                    return 0
            calls = session.reply()
