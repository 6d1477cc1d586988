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


def test_chat_keeps_the_conversation(default_model_dir, monkeypatch, capsys):
    from tokenloom.llm import LLM
    seen = []
    original = LLM.stream

    def spy(self, prompt, params=None):
        seen.append([dict(m) for m in prompt])
        return original(self, prompt, params)
    monkeypatch.setattr(LLM, "stream", spy)
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
