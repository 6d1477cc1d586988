"""`tokenloom chat` in a real terminal (a pty, driven by pexpect), as a user types: Ctrl-C stops a
reply and keeps the conversation, Up recalls the last line, the slash commands answer, Ctrl-D quits,
a paste of several lines is one message."""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest

pexpect = pytest.importorskip("pexpect")


def _ctrl_c_as_on_a_terminal() -> None:
    """SIGINT back to its default in the child, as in a user's terminal: a suite started in the
    background by a non-interactive shell ignores it, the child inherits that, and Python then
    never turns Ctrl-C at the prompt into KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def chat(default_model_dir, tmp_path):
    env = {**os.environ, "TOKENLOOM_CACHE": str(tmp_path / "cache"), "TERM": "dumb"}
    child = pexpect.spawn(
        sys.executable,
        [
            "-m",
            "tokenloom",
            "chat",
            "-m",
            str(default_model_dir),
            "--temp",
            "0",
            "-n",
            "400",
            "--ignore-eos",
            "--max-model-len",
            "1024",
        ],
        cwd=str(tmp_path),
        env=env,
        encoding="utf-8",
        timeout=120,
        dimensions=(40, 200),
        preexec_fn=_ctrl_c_as_on_a_terminal,
    )
    child.expect_exact("> ")
    yield child
    child.close(force=True)


def test_ctrl_c_stops_the_reply_and_keeps_the_conversation(chat, tmp_path):
    chat.sendline("Tell me a long story about a dragon.")
    chat.expect_exact("dragon.")  # the terminal's echo of the line (words, but not the reply)
    # the reply is streaming: words on a line of their own, not a "> " prompt's echo...
    chat.expect(r"\n[^\r\n>]*\w+ \w+ \w+ \w+ \w+")
    chat.sendintr()  # ... Ctrl-C
    chat.expect(r"\[stopped; (\d+) tokens")
    assert int(chat.match.group(1)) < 400  # cut short, not run to max tokens
    chat.expect_exact("> ")  # still in the session
    chat.sendline("/save talk.json")
    chat.expect_exact("saved 2 messages to talk.json")
    saved = json.loads((tmp_path / "talk.json").read_text())["messages"]
    assert [m["role"] for m in saved] == ["user", "assistant"] and saved[1]["content"].strip()

    chat.expect_exact("> ")
    chat.send("\x1b[A")  # Up: the last line comes back...
    chat.send("\r")  # ... and runs again
    chat.expect_exact("saved 2 messages to talk.json")

    for command, answer in [
        ("/reset", "conversation cleared"),
        ("/help", "/system TEXT"),
        ("/system Be terse.", "system prompt set"),
        ("/hello", "unknown command /hello"),
    ]:
        chat.expect_exact("> ")
        chat.sendline(command)
        chat.expect_exact(answer)
    chat.expect_exact("> ")
    chat.sendline("/save empty.json")
    chat.expect_exact("saved 1 messages")  # reset kept only the new system prompt
    chat.expect_exact("> ")
    chat.sendeof()  # Ctrl-D quits
    chat.expect(pexpect.EOF)
    chat.close()
    assert chat.exitstatus == 0


def test_ctrl_c_at_the_prompt_does_not_quit(chat):
    chat.sendintr()
    chat.expect_exact("Ctrl-D or /exit quits")
    chat.expect_exact("> ")
    chat.sendline("/exit")
    chat.expect(pexpect.EOF)
    chat.close()
    assert chat.exitstatus == 0


def test_a_paste_of_several_lines_is_one_message(chat, tmp_path):
    assert "\x1b[?2004h" in chat.before  # bracketed paste mode on, before the first prompt
    chat.send("\x1b[200~Tell me a long story\rabout a dragon.\x1b[201~")  # as the terminal sends a paste...
    chat.send("\r")  # ... then Enter
    chat.expect_exact("about a dragon.")  # the echo, not yet the reply
    chat.expect(r"\w+ \w+ \w+ \w+ \w+")  # one reply is streaming
    chat.sendintr()
    chat.expect_exact("[stopped; ")
    chat.expect_exact("> ")
    chat.sendline("/save talk.json")
    chat.expect_exact("saved 2 messages to talk.json")
    saved = json.loads((tmp_path / "talk.json").read_text())["messages"]
    assert saved[0] == {"role": "user", "content": "Tell me a long story\nabout a dragon."}
    chat.expect_exact("> ")
    chat.sendeof()
    chat.expect(pexpect.EOF)
    assert "\x1b[?2004l" in chat.before  # and off again as the chat ends
    chat.close()
    assert chat.exitstatus == 0
