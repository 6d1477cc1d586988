"""Models by Hub name, against a local server that speaks the Hub's API (tests/helpers/fake_hub.py):
names and tags as ollama / llama.cpp / vLLM take them, only the files a run needs, resumed
downloads, offline use, and an error a user can act on for each way it fails."""

from __future__ import annotations

import huggingface_hub
import pytest

from tests.helpers.fake_hub import FakeHub, Repo
from tests.helpers.gguf_writer import write_gguf
from tests.helpers.server_harness import ThreadedServer, free_port
from tokenloom import LLM, SamplingParams
from tokenloom.loader import hf_hub
from tokenloom.loader.hf_hub import HubError, HubName, choose_gguf, gguf_tags, parse_name

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = "The quick brown fox"


def test_names_parse_as_ollama_llama_cpp_and_vllm_write_them():
    assert parse_name("Qwen/Qwen2.5-0.5B-Instruct") == HubName("Qwen/Qwen2.5-0.5B-Instruct")
    assert parse_name("bartowski/Llama-3.2-1B-Instruct-GGUF:q4_k_m") == HubName(
        "bartowski/Llama-3.2-1B-Instruct-GGUF", "q4_k_m"
    )
    assert parse_name("hf.co/org/repo-GGUF:Q8_0") == HubName("org/repo-GGUF", "Q8_0")
    assert parse_name("https://huggingface.co/org/repo@v1.0") == HubName("org/repo", None, "v1.0")
    assert parse_name("org/repo:IQ4_XS@abc123") == HubName("org/repo", "IQ4_XS", "abc123")
    for not_a_name in ["smollm2-135m", "./models/x", "/abs/path", "a/b/c", "org/repo:bad tag", ""]:
        assert parse_name(not_a_name) is None, not_a_name


def test_tags_are_read_from_file_names_and_chosen_as_llama_cpp_does():
    files = [
        "README.md",
        "Model-Q4_K_M.gguf",
        "Model-Q8_0.gguf",
        "model.IQ4_XS.gguf",
        "mmproj-model-f16.gguf",
        "BF16/Model-BF16-00002-of-00002.gguf",
        "BF16/Model-BF16-00001-of-00002.gguf",
    ]
    tags = gguf_tags(files)
    assert set(tags) == {"Q4_K_M", "Q8_0", "IQ4_XS", "BF16"}  # the projector is not a model
    assert tags["BF16"] == ["BF16/Model-BF16-00001-of-00002.gguf", "BF16/Model-BF16-00002-of-00002.gguf"]
    assert choose_gguf(files, HubName("o/r")) == ["Model-Q4_K_M.gguf"]  # the default tag
    assert choose_gguf(files, HubName("o/r", "q8_0")) == ["Model-Q8_0.gguf"]  # any case
    assert choose_gguf(["only-F16.gguf"], HubName("o/r")) == ["only-F16.gguf"]
    with pytest.raises(HubError, match=r"no GGUF tagged 'Q2_K'; its tags: BF16, IQ4_XS, Q4_K_M, Q8_0"):
        choose_gguf(files, HubName("o/r", "Q2_K"))
    with pytest.raises(HubError, match=r"several GGUF quants; name one as o/r:TAG \(tags: Q4_0, Q8_0\)"):
        choose_gguf(["m-Q8_0.gguf", "m-Q4_0.gguf"], HubName("o/r"))
    with pytest.raises(HubError, match=r"o/r:Q4_K_M matches several GGUF files in o/r: m-Q4_K_M-imat.gguf, m-Q4_K"):
        choose_gguf(["m-Q4_K_M.gguf", "m-Q4_K_M-imat.gguf"], HubName("o/r", "Q4_K_M"))
    untagged = ["Llama-3-8B-fp16.gguf", "weird-00001-of-00002.gguf", "weird-00002-of-00002.gguf", "plain.gguf"]
    assert gguf_tags(untagged) == {
        "FP16": ["Llama-3-8B-fp16.gguf"],
        "PLAIN": ["plain.gguf"],
        "WEIRD": ["weird-00001-of-00002.gguf", "weird-00002-of-00002.gguf"],
    }
    assert choose_gguf(untagged, HubName("o/r", "weird")) == untagged[1:3]  # as `list` names it, any case


@pytest.fixture(scope="module")
def hub_repos(tiny_model_dir, tmp_path_factory):
    """The repos the local Hub serves, and the local files they were made from."""
    folder = tiny_model_dir("llama_gqa")
    made = tmp_path_factory.mktemp("hub_files")
    q8 = write_gguf(folder, made / "tiny-Q8_0.gguf", quantize="Q8_0")
    q4 = write_gguf(folder, made / "tiny-Q4_0.gguf", quantize="Q4_0")
    (made / "split").mkdir()
    write_gguf(folder, made / "split" / "tiny-Q8_0.gguf", quantize="Q8_0", split_max_tensors=8)
    hf_files = Repo.from_folder(folder).files
    repos = {
        "tl/tiny": Repo(hf_files | {"pytorch_model.bin": b"a .bin copy nobody should fetch"}),
        "tl/tiny-GGUF": Repo(
            {"README.md": b"# tiny", q8.name: q8.read_bytes(), q4.name: q4.read_bytes()}, tags=("v1.0", "v2.0")
        ),
        "tl/gated": Repo(hf_files, gated_token="hf_secret"),
        "tl/split-GGUF": Repo.from_folder(made / "split"),
        "tl/pytorch-only": Repo({"config.json": hf_files["config.json"], "pytorch_model.bin": b"weights"}),
        "tl/sharded": Repo(
            {k: v for k, v in hf_files.items() if k != "model.safetensors"}
            | {
                "model-00001-of-00001.safetensors": hf_files["model.safetensors"],
                "model.safetensors.index.json": b'{"weight_map": {"w": "model-00001-of-00001.safetensors"}}',
                "consolidated.safetensors": b"a second copy in another layout, not to fetch",
            }
        ),
    }
    return repos, folder, q8


@pytest.fixture
def hub(hub_repos, tmp_path, monkeypatch):
    """A local Hub and a fresh cache, named by HF_ENDPOINT and HF_HUB_CACHE as a user would."""
    fake = FakeHub(hub_repos[0])
    with ThreadedServer(fake.app) as url:
        monkeypatch.setenv("HF_ENDPOINT", url)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN"):
            monkeypatch.delenv(name, raising=False)
        yield fake, url


def _tokens(model: str) -> list[int]:
    return LLM(model, kv_cache_memory=8 << 20).generate([PROMPT], GREEDY)[0].outputs[0].token_ids


def test_an_hf_repo_by_name_fetches_the_folder_and_generates_as_it(hub, hub_repos):
    fake, _ = hub
    path = hf_hub.fetch(parse_name("tl/tiny"))
    assert path.is_dir() and (path / "config.json").is_file()
    assert "pytorch_model.bin" not in {p for _, p, _ in fake.requests}  # safetensors only
    assert _tokens("tl/tiny") == _tokens(str(hub_repos[1]))
    assert hf_hub.cached_names() == ["tl/tiny"]


def test_a_sharded_repo_fetches_the_shards_its_index_names_only(hub):
    fake, _ = hub
    folder = hf_hub.fetch(parse_name("tl/sharded"))
    assert (folder / "model-00001-of-00001.safetensors").is_file()
    assert "consolidated.safetensors" not in {p for _, p, _ in fake.requests}


def test_a_missing_local_path_is_not_sent_to_the_hub(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    for path in ["models/llama", "llama/model.gguf", "org/x.safetensors"]:
        assert not hf_hub.is_hub_name(path), path
    assert hf_hub.is_hub_name("org/llama")


def test_a_gguf_repo_by_tag_fetches_that_quant_alone(hub, hub_repos):
    fake, _ = hub
    assert _tokens("hf.co/tl/tiny-GGUF:q8_0") == _tokens(str(hub_repos[2]))
    assert {p for _, p, _ in fake.requests} == {"tiny-Q8_0.gguf"}
    with pytest.raises(HubError, match=r"several GGUF quants; name one as tl/tiny-GGUF:TAG \(tags: Q4_0, Q8_0\)"):
        hf_hub.fetch(parse_name("tl/tiny-GGUF"))


def test_a_split_gguf_is_fetched_whole_and_loads_as_one_model(hub, hub_repos):
    first = hf_hub.fetch(parse_name("tl/split-GGUF:q8_0"))
    assert first.name == "tiny-Q8_0-00001-of-00003.gguf"
    assert sorted(p.name for p in first.parent.glob("*.gguf")) == [
        f"tiny-Q8_0-0000{i}-of-00003.gguf" for i in (1, 2, 3)
    ]
    assert _tokens("tl/split-GGUF") == _tokens(str(hub_repos[2]))


def test_a_download_cut_half_way_resumes_from_where_it_stopped(hub):
    """huggingface_hub writes in 10 MiB chunks and, when the connection drops, asks for the rest
    with a Range request: a 24 MiB file cut at 15 MiB is fetched whole, its second request
    starting past 0."""
    fake, _ = hub
    data = bytes(range(256)) * (24 * 4096)
    fake.repos["tl/big-GGUF"] = Repo({"big-Q8_0.gguf": data})
    fake.cut_after[("tl/big-GGUF", "big-Q8_0.gguf")] = 15 << 20
    assert hf_hub.fetch(parse_name("tl/big-GGUF")).read_bytes() == data
    ranges = [r for m, p, r in fake.requests if m == "GET" and p == "big-Q8_0.gguf"]
    assert len(ranges) == 2 and ranges[0] is None, ranges
    assert 0 < int(ranges[1].removeprefix("bytes=").rstrip("-")) <= 15 << 20, ranges  # the rest, not all again


def test_offline_uses_the_cache_and_says_what_is_cached(hub, hub_repos, monkeypatch):
    hf_hub.fetch(parse_name("tl/tiny-GGUF:Q8_0"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hf_hub.fetch(parse_name("tl/tiny-GGUF:Q8_0")).read_bytes() == hub_repos[2].read_bytes()
    with pytest.raises(HubError, match=r"tl/tiny is not in the Hub cache and HF_HUB_OFFLINE=1.*cached: tl/tiny-GGUF"):
        hf_hub.fetch(parse_name("tl/tiny"))


def test_offline_finds_a_revision_by_the_tag_it_was_pulled_by(hub, hub_repos, monkeypatch):
    """`ORG/REPO:QUANT@TAG` pulled online is found offline by the same name (the cache's refs
    name the tag's commit); another tag of the same commit, never asked for, is not cached."""
    online = hf_hub.fetch(parse_name("tl/tiny-GGUF:Q8_0@v1.0"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hf_hub.fetch(parse_name("tl/tiny-GGUF:Q8_0@v1.0")) == online
    assert online.read_bytes() == hub_repos[2].read_bytes()
    with pytest.raises(HubError, match=r"tl/tiny-GGUF:Q8_0@v2.0 is not in the Hub cache and HF_HUB_OFFLINE=1"):
        hf_hub.fetch(parse_name("tl/tiny-GGUF:Q8_0@v2.0"))


def test_the_hub_out_of_reach_names_offline_mode_and_uses_the_cache(hub, hub_repos, monkeypatch):
    hf_hub.fetch(parse_name("tl/tiny-GGUF:Q8_0"))
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    assert hf_hub.fetch(parse_name("tl/tiny-GGUF:Q8_0")).is_file()  # cached: no network needed
    with pytest.raises(HubError, match=r"cannot reach the Hub at .* HF_HUB_OFFLINE=1 .*cached: tl/tiny-GGUF"):
        hf_hub.fetch(parse_name("tl/tiny"))


def test_each_failure_is_an_error_that_says_what_to_do(hub, monkeypatch):
    _, url = hub
    with pytest.raises(HubError, match=r"no model tl/nothing on the Hub .*check the name"):
        hf_hub.fetch(parse_name("tl/nothing"))
    with pytest.raises(HubError, match=rf"tl/gated is gated: accept its terms at {url}/tl/gated .*HF_TOKEN"):
        hf_hub.fetch(parse_name("tl/gated"))
    with pytest.raises(HubError, match=r"tl/pytorch-only has no weights tokenloom can load.*pytorch_model.bin"):
        hf_hub.fetch(parse_name("tl/pytorch-only"))
    with pytest.raises(HubError, match=r"tl/tiny has no revision 'v9'"):
        hf_hub.fetch(parse_name("tl/tiny@v9"))
    assert (hf_hub.fetch(parse_name("tl/gated"), token="hf_secret") / "config.json").is_file()


def test_a_full_disk_is_an_error_naming_it_and_the_resume(hub, monkeypatch):
    """(huggingface_hub keeps the partial file and resumes from it, as the cut download shows.)"""
    import errno

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_space)
    with pytest.raises(HubError, match=r"the disk is full while downloading tl/tiny-GGUF:Q8_0 .*resumes"):
        hf_hub.fetch(parse_name("tl/tiny-GGUF:Q8_0"))


def test_the_cli_and_the_server_take_hub_names(hub, hub_repos, capsys):
    from tokenloom.entrypoints.cli import main as cli_main
    from tokenloom.entrypoints.server import served_names

    expected = LLM(str(hub_repos[2]), kv_cache_memory=8 << 20).generate([PROMPT], GREEDY)[0].outputs[0].text
    argv = ["generate", "-m", "hf.co/tl/tiny-GGUF:Q8_0", "--temp", "0", "-n", "6", "--ignore-eos", PROMPT]
    assert cli_main(argv) == 0
    assert capsys.readouterr().out.startswith(PROMPT + expected)
    assert cli_main(["generate", "-m", "tl/nothing", PROMPT]) != 0
    err = capsys.readouterr().err
    assert "no model tl/nothing on the Hub" in err and "Traceback" not in err
    path = str(hf_hub.fetch(parse_name("tl/tiny-GGUF:Q8_0")))
    assert served_names("tl/tiny-GGUF:Q8_0", path) == ["tl/tiny-GGUF:Q8_0", "tiny-Q8_0"]


def test_pull_list_and_rm_take_hub_names(hub, capsys):
    from tokenloom.entrypoints.cli import main as cli_main

    assert cli_main(["pull", "tl/tiny-GGUF:Q4_0"]) == 0
    assert cli_main(["pull", "tl/tiny"]) == 0
    assert cli_main(["pull", "tl/gated", "--hf-token", "hf_secret"]) == 0
    capsys.readouterr()
    assert cli_main(["list"]) == 0
    listed = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("tl/")}
    assert set(listed) == {"tl/tiny-GGUF:Q4_0", "tl/tiny", "tl/gated"}
    assert cli_main(["rm", "tl/tiny-GGUF:Q4_0"]) == 0 and cli_main(["rm", "tl/tiny"]) == 0
    capsys.readouterr()
    assert cli_main(["list"]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("tl/")] == ["tl/gated"]
    with pytest.raises(SystemExit):  # argparse's usage error, naming both kinds of name
        cli_main(["pull", "no-such-model"])
    assert "or a Hugging Face Hub name ORG/REPO[:QUANT]" in capsys.readouterr().err


def test_the_engine_flags_carry_a_token_to_a_gated_repo(hub, capsys):
    from tokenloom.entrypoints.cli import main as cli_main

    argv = ["generate", "-m", "tl/gated", "--temp", "0", "-n", "3", PROMPT]
    assert cli_main(argv) != 0
    assert "tl/gated is gated" in capsys.readouterr().err
    assert cli_main([*argv, "--hf-token", "hf_secret"]) == 0
    assert capsys.readouterr().out.startswith(PROMPT)
    long_prompt = "word " * 1000  # checked against the context before the load: the model is read with the token
    assert cli_main([*argv[:-1], long_prompt, "--hf-token", "hf_secret"]) != 0
    assert "the prompt is 5000 tokens, but the context is 256" in capsys.readouterr().err
