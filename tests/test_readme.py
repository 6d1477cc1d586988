"""The README's shell examples copy-paste correctly in bash: every `tokenloom ...` command line in
a ```bash block parses (flags, choices), as bash expands it; the stop-string example stops."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parent.parent / "README.md"


def readme_commands() -> list[str]:
    """The `tokenloom ...` commands of the README's bash blocks, comments cut, `;` lists split."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S):
        for line in block.splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).strip()
            commands += [c.strip() for c in line.split(";") if c.strip().startswith("tokenloom ")]
    return commands


def bash_words(command: str) -> list[str]:
    """`command`'s arguments after `tokenloom`, as bash splits and expands them."""
    out = subprocess.run(
        ["bash", "-c", f"printf '%s\\0' {command.removeprefix('tokenloom ')}"], capture_output=True, check=True
    )
    return out.stdout.decode().split("\0")[:-1]


@pytest.mark.parametrize("command", readme_commands())
def test_each_readme_command_parses(command):
    from tokenloom.entrypoints.cli.commands import _explain_mode, build_parser

    words = bash_words(command)
    if "--help" in words:
        with pytest.raises(SystemExit) as done:
            build_parser().parse_args(words)
        assert done.value.code == 0
        return
    args = build_parser().parse_args(_explain_mode(words))
    assert callable(args.func)


def test_the_readme_has_commands_to_check():
    assert len(readme_commands()) >= 15


def test_the_stop_string_example_stops_at_a_blank_line(default_model_dir):
    [command] = [c for c in readme_commands() if "--stop" in c]
    words = bash_words(command)
    assert words[words.index("--stop") + 1] == "\n\n"  # a real blank line, not "\\n\\n"
    run = subprocess.run(
        [sys.executable, "-m", "tokenloom", *words, "-m", str(default_model_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "\n\n" not in run.stdout.rstrip("\n")
