"""The CLI as a user runs it: streamed generate, a two-turn chat, --help."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from tokenloom.cli import main as cli_main


def test_generate_streams_the_continuation(default_model_dir, capsys):
    rc = cli_main(["generate", "--model", str(default_model_dir), "-n", "6", "Once upon a time, there was a little"])
    assert rc == 0
    assert capsys.readouterr().out.startswith("Once upon a time, there was a little girl named Emma")


def test_generate_with_chat_template(default_model_dir, capsys):
    assert cli_main(["generate", "-m", str(default_model_dir), "--chat", "What is the capital of France?"]) == 0
    assert capsys.readouterr().out.strip() == "The capital of France is Paris."


def test_generate_explain_prints_a_readable_record_per_token(default_model_dir, capsys):
    assert cli_main(["generate", "-m", str(default_model_dir), "-n", "6", "--explain",
                     "Once upon a time, there was a little"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert all(len(line) <= 80 for line in lines) and "\x1b[" not in out     # not a TTY: no colors
    steps = [line for line in lines if line[:4].strip().isdigit()]
    assert [int(line[:4]) for line in steps] == list(range(6))
    assert " p 0." in steps[0] and "KV " in steps[0] and "' girl'" in steps[0]
    assert sum(line.startswith("      alt ") for line in lines) == 6
    assert lines[-1] == "Once upon a time, there was a little girl named Emma who loved to"   # as without --explain


def test_generate_explain_full_tabulates_20_candidates(default_model_dir, capsys):
    assert cli_main(["generate", "-m", str(default_model_dir), "-n", "2", "--explain=full", "-t", "0.7",
                     "--top-p", "0.5", "--seed", "1", "Paris is"]) == 0
    out = capsys.readouterr().out
    assert out.count("     > ") == 2 and out.count("top_p") >= 2 and "KV blocks in use" in out
    assert all(len(line) <= 80 for line in out.splitlines())


def test_chat_keeps_the_conversation(default_model_dir, monkeypatch, capsys):
    from tokenloom.cli_chat import ChatSession
    seen = []
    original = ChatSession.reply

    def spy(self, out=None):
        seen.append([dict(m) for m in self.history])     # the conversation each turn is generated from
        return original(self, out)
    monkeypatch.setattr(ChatSession, "reply", spy)
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is the capital of France?\nAnd of Italy?\n/exit\n"))
    assert cli_main(["chat", "-m", str(default_model_dir), "-n", "20"]) == 0
    out = capsys.readouterr().out
    assert "The capital of France is Paris." in out
    assert [m["role"] for m in seen[1]] == ["user", "assistant", "user"]
    assert seen[1][1]["content"] == "The capital of France is Paris."


@pytest.mark.parametrize("args", [["--help"], ["generate", "--help"], ["chat", "--help"], ["pull", "--help"]])
def test_help(args):
    out = subprocess.run([sys.executable, "-m", "tokenloom.cli", *args], capture_output=True, text=True)
    assert out.returncode == 0 and "usage: tokenloom" in out.stdout


def test_serve_refuses_a_bad_admission_bound_before_loading_the_model(capsys, monkeypatch):
    from tokenloom import cli
    monkeypatch.setattr(cli, "make_llm", lambda args: pytest.fail("the model was loaded before the flags were checked"))
    assert cli.main(["serve", "--max-pending-seqs", "0"]) == 2
    assert "admission limit max_pending_seqs must be >= 1, got 0" in capsys.readouterr().err
