"""The CLI as a user runs it: streamed generate, a two-turn chat, --help."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from tokenloom.entrypoints.cli.commands import main as cli_main


def test_generate_streams_the_continuation(default_model_dir, capsys):
    rc = cli_main(
        [
            "generate",
            "--model",
            str(default_model_dir),
            "--temp",
            "0",
            "-n",
            "6",
            "Once upon a time, there was a little",
        ]
    )
    assert rc == 0
    assert capsys.readouterr().out.startswith("Once upon a time, there was a little girl named Emma")


def test_generate_with_chat_template(default_model_dir, capsys):
    assert (
        cli_main(["generate", "-m", str(default_model_dir), "--temp", "0", "--chat", "What is the capital of France?"])
        == 0
    )
    assert capsys.readouterr().out.strip() == "The capital of France is Paris."


def test_generate_explain_prints_a_readable_record_per_token(default_model_dir, capsys):
    assert (
        cli_main(
            [
                "generate",
                "-m",
                str(default_model_dir),
                "-n",
                "6",
                "--explain",
                "--temp",
                "0",
                "Once upon a time, there was a little",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert all(len(line) <= 80 for line in lines) and "\x1b[" not in out  # not a TTY: no colors
    steps = [line for line in lines if line[:4].strip().isdigit()]
    assert [int(line[:4]) for line in steps] == list(range(6))
    assert " p 0." in steps[0] and "KV " in steps[0] and "' girl'" in steps[0]
    assert sum(line.startswith("      alt ") for line in lines) == 6
    assert lines[-1] == "Once upon a time, there was a little girl named Emma who loved to"  # as without --explain


def test_generate_explain_full_tabulates_20_candidates(default_model_dir, capsys):
    assert (
        cli_main(
            [
                "generate",
                "-m",
                str(default_model_dir),
                "-n",
                "2",
                "--explain=full",
                "--temp",
                "0.7",
                "--top-p",
                "0.5",
                "--seed",
                "1",
                "Paris is",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.count("     > ") == 2 and out.count("top_p") >= 2 and "KV blocks in use" in out
    assert all(len(line) <= 80 for line in out.splitlines())


def test_chat_keeps_the_conversation(default_model_dir, monkeypatch, capsys):
    from tokenloom.entrypoints.cli.chat import ChatSession

    seen = []
    original = ChatSession.reply

    def spy(self, out=None, **kwargs):
        seen.append([dict(m) for m in self.history])  # the conversation each turn is generated from
        return original(self, out, **kwargs)

    monkeypatch.setattr(ChatSession, "reply", spy)
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is the capital of France?\nAnd of Italy?\n/exit\n"))
    assert cli_main(["chat", "-m", str(default_model_dir), "--temp", "0", "-n", "20"]) == 0
    out = capsys.readouterr().out
    assert "The capital of France is Paris." in out
    assert [m["role"] for m in seen[1]] == ["user", "assistant", "user"]
    assert seen[1][1]["content"] == "The capital of France is Paris."


def test_chat_goes_on_past_the_context_and_drops_its_oldest_turns(default_model_dir, monkeypatch, capsys):
    """Context shift is on in chat: a reply longer than the context goes on, keeping the system
    prompt; the next turn's prompt drops the oldest turn after the system prompt to fit."""
    from tokenloom.entrypoints.cli.chat import ChatSession

    seen, sessions = [], []
    original = ChatSession.reply

    def spy(self, out=None, **kwargs):
        sessions.append(self)
        result = original(self, out, **kwargs)
        seen.append([dict(m) for m in self.history])  # what the turn was generated from, and its reply
        return result

    monkeypatch.setattr(ChatSession, "reply", spy)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Tell a long story.\nAnother.\n/exit\n"))
    argv = ["chat", "-m", str(default_model_dir), "--temp", "0", "-n", "120", "--ignore-eos", "--max-model-len", "128"]
    assert cli_main([*argv, "--system", "You tell stories."]) == 0
    err = capsys.readouterr().err
    engine = sessions[0].llm.engine
    assert engine.core.scheduler.num_context_shifts >= 1  # 120 new tokens after the prompt, in 128
    assert "120 tokens" in err  # the whole reply came
    assert [m["role"] for m in seen[0]] == ["system", "user", "assistant"]
    assert [m["role"] for m in seen[1]] == ["system", "user", "assistant"]  # the first turn left
    assert seen[1][1]["content"] == "Another." and "left the context" in err


@pytest.mark.parametrize("args", [["--help"], ["generate", "--help"], ["chat", "--help"], ["pull", "--help"]])
def test_help(args):
    out = subprocess.run([sys.executable, "-m", "tokenloom", *args], capture_output=True, text=True)
    assert out.returncode == 0 and "usage: tokenloom" in out.stdout


def test_serve_refuses_a_bad_admission_bound_before_loading_the_model(capsys, monkeypatch):
    from tokenloom.entrypoints.cli import commands as cli
    from tokenloom.entrypoints.cli import serve

    monkeypatch.setattr(serve, "make_llm", lambda args: pytest.fail("the model loaded before the flags were checked"))
    assert cli.main(["serve", "--max-pending-seqs", "0"]) == 2
    assert "admission limit max_pending_seqs must be >= 1, got 0" in capsys.readouterr().err
    assert cli.main(["serve", "--max-loaded-models", "0"]) == 2
    assert "--max-loaded-models must be at least 1 (got 0)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["serve", "--keep-alive", "soon"])
    assert "'soon' is not a duration" in capsys.readouterr().err


def test_generate_takes_the_prompt_with_llama_cpps_p_flag(capsys, monkeypatch):
    """`-p "text"` is the prompt (llama.cpp's spelling), not an abbreviation of -pp; given twice, an error."""
    from tokenloom.entrypoints.cli import commands as cli

    class PromptRead(BaseException):  # stops the command where it has its prompt (no model load)
        pass

    def read(args, prompt):
        raise PromptRead(prompt)

    monkeypatch.setattr(cli, "check_prompt_early", read)
    with pytest.raises(PromptRead, match="^Hello there$"):
        cli.main(["generate", "-p", "Hello there", "-n", "2"])
    monkeypatch.setattr(cli, "make_llm", lambda args: pytest.fail("the model was loaded"))
    assert cli.main(["generate", "-p", "Hello", "again", "-n", "2"]) != 0
    assert "give the prompt once" in capsys.readouterr().err


# ---- defaults, flags and early errors -------------------------------------------------------------
def test_left_out_sampling_flags_take_llama_cpps_defaults(default_model_dir, capsys):
    from tokenloom import LLM
    from tokenloom.sampling_params import SamplingParams

    assert (
        cli_main(
            ["generate", "-m", str(default_model_dir), "--seed", "3", "-n", "12", "--no-display-prompt", "The ocean"]
        )
        == 0
    )
    captured = capsys.readouterr()
    llm = LLM(str(default_model_dir), max_model_len=256, kv_cache_memory=32 << 20)
    want = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=3, max_tokens=12)
    assert captured.out.rstrip("\n") == llm.generate("The ocean", want)[0].outputs[0].text  # no prompt echoed
    assert "tokens, " in captured.err and "tok/s" in captured.err  # the summary line, on stderr


def test_version_and_threads(capsys, default_model_dir):
    import torch

    with pytest.raises(SystemExit) as exit_:
        cli_main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("tokenloom 0.")
    threads = torch.get_num_threads()
    try:
        assert cli_main(["generate", "-m", str(default_model_dir), "-t", "1", "-n", "2", "--temp", "0", "Hi"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def no_model_load(monkeypatch):
    """Any model load fails the test: the error must come before it."""
    from tokenloom.entrypoints.cli import commands as cli

    monkeypatch.setattr(cli, "make_llm", lambda args: pytest.fail("the model was loaded before the error"))


@pytest.mark.parametrize(
    "argv,message",
    [
        (["generate", "   "], "the prompt is empty"),
        (["generate", "--max-model-len", "256", "word " * 700], "the prompt is 70"),
        (["generate", "-c", "256", "word " * 700], "but the context is 256"),
        (["generate", "--ctx-size", "300", "word " * 700], "but the context is 300"),
        (["generate", "--json-schema", "no-such-schema.json", "Hi"], "--json-schema: no file 'no-such-schema.json'"),
        (["generate", "--json-schema", "{not json", "Hi"], "--json-schema: invalid JSON"),
        (["generate", "--grammar", "no-such.lark", "Hi"], "--grammar: cannot read 'no-such.lark'"),
        (["generate", "-t", "0", "Hi"], "--threads must be >= 1, got 0"),
        (["generate", "--decode-steps", "0", "Hi"], "--decode-steps must be >= 1, got 0"),
        (["generate", "--explain=foo", "Hi"], "--explain=foo: use --explain (compact) or --explain=compact|full"),
    ],
)
def test_bad_input_fails_before_the_model_loads(no_model_load, default_model_dir, capsys, argv, message):
    try:
        code = cli_main([argv[0], "-m", str(default_model_dir), *argv[1:]])
    except SystemExit as e:  # what argparse-level errors end in
        code = e.code
    assert code == 2 and message in capsys.readouterr().err


def test_generate_into_a_closed_pipe_ends_quietly(default_model_dir):
    cmd = (
        f"{sys.executable} -m tokenloom generate -m {default_model_dir} --temp 0 -n 200 --ignore-eos "
        "'Once upon a time' | head -c 20"
    )
    run = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, timeout=300)
    assert run.stdout == "Once upon a time, th"[:20] and "Traceback" not in run.stderr and run.returncode == 0


def test_the_cli_sizes_the_kv_cache_to_one_context(default_model_dir, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="tokenloom")
    assert (
        cli_main(["generate", "-m", str(default_model_dir), "--max-model-len", "1000", "--temp", "0", "-n", "2", "Hi"])
        == 0
    )
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:")]
    assert line.startswith("KV cache: 1008 tokens (63 blocks x 16)")  # 1000 tokens in blocks of 16, not 1 GiB


def test_the_cli_and_a_loaded_model_leave_the_server_stack_unimported(default_model_dir):
    """generate, chat and bench do not pay for FastAPI, pydantic and prometheus-client (~20 MiB
    resident, ~0.2 s): the parser reads serve's defaults from admission.py without them, and `serve`
    imports them itself (checked in a fresh process)."""
    import subprocess
    import sys

    code = (
        "import sys; from tokenloom.entrypoints.cli import commands; from tokenloom.entrypoints.llm import LLM; "
        "commands.build_parser(); "
        f"LLM({str(default_model_dir)!r}, max_model_len=64); "
        "print(*[m in sys.modules for m in ('fastapi', 'pydantic', 'prometheus_client', 'starlette')]); "
        "from tokenloom.entrypoints.server import build_app; print('fastapi' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False"] * 4 + ["True"]


def test_a_chat_without_a_template_and_a_port_in_use_fail_before_the_model_loads(
    no_model_load, tiny_model_dir, default_model_dir, capsys
):
    import socket

    base = str(tiny_model_dir("llama_gqa"))  # a tokenizer without a chat template
    assert cli_main(["generate", "-m", base, "--chat", "Hi"]) == 2
    assert "--chat: the model at" in capsys.readouterr().err
    assert cli_main(["chat", "-m", base]) == 2
    assert "tokenloom chat: the model at" in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli_main(["serve", "-m", str(default_model_dir), "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_stderr_to_a_file_gets_log_lines_and_no_progress_bars(tiny_model_dir, tmp_path):
    """A server's (or any command's) stderr in a file: timestamped log lines with their level, no
    progress bar redrawn with carriage returns; at a terminal the short lines and bars stay."""
    import re
    import subprocess
    import sys

    log = tmp_path / "stderr.log"
    with open(log, "w") as err:
        command = [
            sys.executable,
            "-m",
            "tokenloom",
            "generate",
            "-m",
            str(tiny_model_dir("llama_gqa")),
            "-n",
            "2",
            "--temp",
            "0",
            "Hi",
        ]
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=err, timeout=120)
    text = log.read_text()
    assert done.returncode == 0, text
    assert "\r" not in text and "loading weights" not in text
    assert re.search(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ INFO tokenloom[\w.]*: KV cache: ", text, re.M), text


class RecordingSession:
    """Stands in for ChatSession in chat_loop: each turn's user message is recorded, the reply is "ok"."""

    def __init__(self) -> None:
        self.history: list[dict] = []
        self.system = None
        self.turns: list[str] = []

    def reply(self, out=None, stopped=lambda: False) -> list[dict]:
        self.turns.append(self.history[-1]["content"])
        self.history.append({"role": "assistant", "content": "ok"})
        return []


def reading(lines: list[str], prompts: list[str]):
    """A `read` for chat_loop: the lines in order (prompts recorded), then Ctrl-D."""
    it = iter(lines)

    def read(prompt: str) -> str:
        prompts.append(prompt)
        line = next(it, None)
        if line is None:
            raise EOFError
        return line

    return read


def test_chat_takes_a_triple_quote_block_as_one_message():
    from tokenloom.entrypoints.cli.chat import chat_loop

    session, prompts = RecordingSession(), []
    lines = [
        '"""',
        "line one",
        "  /line two, not a command",
        "line three",
        '"""',
        '"""Just one line."""',
        '"""first',
        'last"""',
        "/exit",
    ]
    assert chat_loop(session, reading(lines, prompts)) == 0
    assert session.turns == ["line one\n  /line two, not a command\nline three", "Just one line.", "first\nlast"]
    assert prompts[:6] == ["> ", "... ", "... ", "... ", "... ", "> "]


def test_chat_takes_a_bracketed_paste_over_several_lines_as_one_message():
    from tokenloom.entrypoints.cli.chat import chat_loop

    session, prompts = RecordingSession(), []
    lines = [
        "Sum up: \x1b[200~first line",
        "/second line, not a command",
        "",
        "third\x1b[201~ please",
        "\x1b[200~a paste that ends with a newline",
        "\x1b[201~",
        "/exit",
    ]
    assert chat_loop(session, reading(lines, prompts)) == 0
    assert session.turns == [
        "Sum up: first line\n/second line, not a command\n\nthird please",
        "a paste that ends with a newline\n",
    ]


def test_piped_chat_input_is_a_message_a_line_and_never_turns_bracketed_paste_on(monkeypatch, capsys):
    from tokenloom.entrypoints.cli.chat import chat_loop

    session = RecordingSession()
    monkeypatch.setattr(sys, "stdin", io.StringIO('Hello.\nHow are you?\n"""\nline one\nline two\n"""\nBye.\n'))
    assert chat_loop(session) == 0  # with input(), as `tokenloom chat < file` runs
    assert session.turns == ["Hello.", "How are you?", "line one\nline two", "Bye."]
    assert "\x1b[?2004" not in capsys.readouterr().out


def _screen_lines(raw: str) -> list[str]:
    """What a terminal shows of `raw`: each line as its carriage returns overwrite it."""
    shown = []
    for line in raw.replace("\r\n", "\n").split("\n"):
        screen = ""
        for part in line.split("\r"):
            screen = part + screen[len(part) :]
        shown.append(screen.rstrip())
    return shown


def test_the_weights_bar_leaves_the_terminal_to_the_log_lines(default_gguf_path):
    """At a terminal the load shows a bar, then clears it: no log line is written on its end."""
    import fcntl
    import os
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    cmd = [sys.executable, "-m", "tokenloom", "generate", "-m", str(default_gguf_path), "-n", "2", "Hi"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=follower, stdin=subprocess.DEVNULL)
    os.close(follower)
    raw = b""
    while True:
        try:
            chunk = os.read(leader, 1 << 16)
        except OSError:  # EIO: the process closed its end
            break
        if not chunk:
            break
        raw += chunk
    os.close(leader)
    assert proc.wait(timeout=120) == 0
    text = raw.decode(errors="replace")
    assert "loading weights" in text  # a bar was drawn at the terminal
    shown = [line for line in _screen_lines(text) if line]
    assert not any("loading weights" in line for line in shown), shown  # and cleared
    assert any(line.startswith("tokenloom: sampling settings") for line in shown), shown


def test_the_command_runs_exit_handlers_and_keeps_its_exit_code(tiny_model_dir):
    """`tokenloom` skips Python's module teardown at exit, but not the atexit handlers (a chat's
    history save), the whole answer on stdout, or the exit code; the garbage collector it paused
    for start-up runs again once the model is loaded, start-up's objects frozen out of its view."""
    code = (
        "import atexit, sys\n"
        "import gc\n"
        "atexit.register(lambda: print('handler ran', gc.isenabled(), gc.get_freeze_count() > 0, file=sys.stderr))\n"
        "from tokenloom.entrypoints.cli import console_main\n"
        "sys.argv = ['tokenloom', *sys.argv[1:]]\n"
        "console_main()\n"
    )
    model = str(tiny_model_dir("llama_gqa"))
    run = [sys.executable, "-c", code, "generate", "-m", model, "--temp", "0", "-n", "5", "--no-display-prompt"]
    done = subprocess.run([*run, "The quick"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "handler ran True True" in done.stderr
    from tokenloom import LLM, SamplingParams

    want = LLM(model, kv_cache_memory=8 << 20).generate("The quick", SamplingParams(max_tokens=5, temperature=0))
    assert done.stdout.strip() == want[0].outputs[0].text.strip()
    failed = subprocess.run([*run, "--top-p", "7", "hi"], capture_output=True, text=True, timeout=120)
    assert failed.returncode == 2 and "handler ran" in failed.stderr
