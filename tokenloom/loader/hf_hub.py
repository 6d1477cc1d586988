"""Models by Hugging Face Hub name, fetched with huggingface_hub into its shared cache.

Names, as ollama, llama.cpp and vLLM take them:
- ``ORG/REPO``: an HF model repo (config, tokenizer, chat template, generation config and the
  safetensors weights; not also .bin or .pth copies), or a GGUF repo's default quant;
- ``ORG/REPO:TAG``: one quant of a GGUF repo, TAG matched case-insensitively against the file
  names (``Q4_K_M``, ``q8_0``, ``IQ4_XS``, ``F16``); without a tag, ``Q4_K_M`` if the repo has it,
  else its only GGUF, else an error listing its tags;
- an ``hf.co/`` or ``https://huggingface.co/`` prefix, and ``@REVISION`` at the end.

The cache is huggingface_hub's (``HF_HOME`` / ``HF_HUB_CACHE``, shared with transformers), as are
its endpoint (``HF_ENDPOINT``), token (``HF_TOKEN``), offline mode (``HF_HUB_OFFLINE=1``),
progress bars and resumable downloads. Every failure is a ``HubError`` saying what to do.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

_PREFIXES = ("https://huggingface.co/", "http://huggingface.co/", "huggingface.co/", "hf.co/")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
DEFAULT_TAG = "Q4_K_M"
# A GGUF file's quant tag: ggml type names as llama-quantize writes them into file names.
_TAG = re.compile(
    r"(?<![A-Za-z0-9])(I?Q\d_[A-Z0-9_]*?|Q\d+|BF16|F16|FP16|F32|MXFP4(?:_MOE)?|TQ\d_\d)(?=[.\-/]|$)", re.I
)
_INDEX = "model.safetensors.index.json"
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
# The files an HF model folder needs besides its weights.
_FOLDER_FILES = re.compile(
    r"^(config\.json|generation_config\.json|tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json"
    r"|chat_template\.(jinja|json)|tokenizer\.model|vocab\.json|merges\.txt|added_tokens\.json)$"
)


class HubError(RuntimeError):
    """A Hub name that cannot be fetched; the message says why and what to do."""


@dataclass(frozen=True)
class HubName:
    repo_id: str
    tag: str | None = None
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo_id + (f":{self.tag}" if self.tag else "") + (f"@{self.revision}" if self.revision else "")


def parse_name(text: str) -> HubName | None:
    """`text` as a Hub name, or None where it is not one (a path, a bare word)."""
    name = text.strip()
    for prefix in _PREFIXES:
        if name.lower().startswith(prefix):
            name = name[len(prefix) :]
            break
    name, _, revision = name.partition("@")
    repo_id, _, tag = name.partition(":")
    if not _REPO_ID.match(repo_id) or (tag and not re.fullmatch(r"[\w.-]+", tag)):
        return None
    return HubName(repo_id, tag or None, revision or None)


def is_hub_name(text: str) -> bool:
    """A name to fetch from the Hub: it parses as one and is not a path here (one that exists,
    a file name with a weights suffix, or one under a folder that exists)."""
    path = Path(text)
    if path.exists() or path.suffix in (".gguf", ".safetensors") or (path.parent.is_dir() and str(path.parent) != "."):
        return False
    return parse_name(text) is not None


def gguf_tags(files: list[str]) -> dict[str, list[str]]:
    """Upper-cased quant tag -> the GGUF files holding that quant (a split model's shards in order).
    Projector files (mmproj) are not models and are left out."""
    tags: dict[str, list[str]] = {}
    for path in sorted(files):
        base = path.rsplit("/", 1)[-1]
        if not base.endswith(".gguf") or base.lower().startswith("mmproj"):
            continue
        found = _TAG.findall(path)
        tags.setdefault(found[-1].upper() if found else _SPLIT.sub(".gguf", base)[: -len(".gguf")].upper(), []).append(
            path
        )
    return tags


def choose_gguf(files: list[str], name: HubName) -> list[str]:
    """The GGUF files `name` asks for (several where the quant is split into shards)."""
    tags = gguf_tags(files)
    listed = ", ".join(sorted(tags)) or "none"
    if name.tag:
        chosen = tags.get(name.tag.upper())
        if chosen is None:
            raise HubError(f"{name.repo_id} has no GGUF tagged {name.tag!r}; its tags: {listed}")
        return _one_model(chosen, name)
    if DEFAULT_TAG in tags:
        return _one_model(tags[DEFAULT_TAG], name)
    if len(tags) == 1:
        return _one_model(next(iter(tags.values())), name)
    raise HubError(f"{name.repo_id} holds several GGUF quants; name one as {name.repo_id}:TAG (tags: {listed})")


def _one_model(files: list[str], name: HubName) -> list[str]:
    """`files` if they are one model (one file, or the shards of one split), else a HubError
    naming them: a tag the file names share (Model-Q4_K_M.gguf and Model-Q4_K_M-imat.gguf)."""
    one_split = all(_SPLIT.search(f) for f in files) and len({_SPLIT.sub("", f) for f in files}) == 1
    if len(files) == 1 or one_split:
        return files
    raise HubError(f"{name} matches several GGUF files in {name.repo_id}: {', '.join(files)}; name a tag of one")


def folder_files(files: list[str], repo_id: str) -> list[str]:
    """The files of an HF model repo that tokenloom loads: the folder's config and tokenizer files
    and its safetensors weights (with their index)."""
    weights = [f for f in files if "/" not in f and f.endswith((".safetensors", ".safetensors.index.json"))]
    if not weights:
        other = [f for f in files if f.endswith((".bin", ".pth", ".pt", ".onnx", ".msgpack", ".h5"))]
        found = f" (it has {', '.join(sorted(other)[:4])})" if other else ""
        raise HubError(f"{repo_id} has no weights tokenloom can load: it reads safetensors and GGUF files{found}")
    return sorted(f for f in files if _FOLDER_FILES.match(f)) + sorted(weights)


def endpoint() -> str:
    """The Hub's address: HF_ENDPOINT as the environment has it now (huggingface_hub reads it once,
    at import)."""
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def cache_folder() -> str:
    """huggingface_hub's cache: HF_HUB_CACHE, else HF_HOME/hub, else its default."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    return os.path.join(os.environ["HF_HOME"], "hub") if os.environ.get("HF_HOME") else constants.HF_HUB_CACHE


def offline() -> bool:
    """HF_HUB_OFFLINE=1 (or TRANSFORMERS_OFFLINE=1): use only what is cached."""
    flag = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return flag.strip().upper() in ("1", "ON", "YES", "TRUE")


def fetch(name: HubName, token: str | None = None, force: bool = False) -> Path:
    """Download what `name` needs into the Hub cache (files already there are not fetched again,
    unless `force`) -> the GGUF file (a split model's first shard) or the HF model folder."""
    import huggingface_hub

    try:
        files, cached = _repo_files(name, token)

        def download(filename: str) -> str:
            return huggingface_hub.hf_hub_download(
                name.repo_id,
                filename,
                revision=name.revision,
                token=token,
                endpoint=endpoint(),
                cache_dir=cache_folder(),
                local_files_only=cached,
                force_download=force and not cached,
            )

        as_gguf = name.tag or (gguf_tags(files) and not any(f.endswith(".safetensors") for f in files))
        wanted = choose_gguf(files, name) if as_gguf else folder_files(files, name.repo_id)
        if _INDEX in wanted:  # only the shards the index names (not also a consolidated copy)
            shards = set(json.loads(Path(download(_INDEX)).read_text())["weight_map"].values())
            wanted = [f for f in wanted if not f.endswith(".safetensors") or f in shards]
        paths = [download(f) for f in wanted]
    except HubError:
        raise
    except Exception as e:  # huggingface_hub's errors, the network's, the disk's
        raise _hub_error(name, e) from None
    first = Path(paths[0])
    return first if wanted[0].endswith(".gguf") else first.parent


def _repo_files(name: HubName, token: str | None) -> tuple[list[str], bool]:
    """(the repo's file paths, whether they come from the cache): from the Hub, else, offline or
    with the Hub out of reach, from the revision's cached snapshot."""
    import huggingface_hub

    if not offline():
        try:
            # model_info, not list_repo_files: one request, without the backoff that keeps a
            # user whose network is down waiting half a minute per call
            info = huggingface_hub.HfApi(endpoint=endpoint(), token=token).model_info(
                name.repo_id, revision=name.revision, timeout=10
            )
            return [s.rfilename for s in info.siblings or []], False
        except Exception as e:
            if not _is_network_error(e):
                raise
            unreachable: Exception | None = e
    else:
        unreachable = None
    cached = _cached_files(name)
    if cached is None:
        raise _not_cached(name, unreachable)
    return cached, True


def _cached_files(name: HubName) -> list[str] | None:
    """The files of `name`'s cached snapshot (relative paths), or None where none is cached."""
    import huggingface_hub
    from huggingface_hub import errors

    try:
        folder = Path(
            huggingface_hub.snapshot_download(
                name.repo_id, revision=name.revision, cache_dir=cache_folder(), local_files_only=True
            )
        )
    except errors.IncompleteSnapshotError as e:  # some files of the revision cached, not all: enough here
        folder = Path(e.snapshot_path)
    except Exception:
        return None
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def _is_network_error(e: BaseException) -> bool:
    """A failure to reach the Hub: a connection or timeout error of the HTTP client that
    huggingface_hub uses (httpx2 from huggingface_hub 2, httpx before it) or of the system."""
    import importlib

    kinds: list[type] = [ConnectionError, TimeoutError]
    for client in ("httpx2", "httpx"):
        try:
            kinds.append(importlib.import_module(client).TransportError)
        except ImportError:
            continue
    return isinstance(e, tuple(kinds))


def _cached_repos() -> list:
    """huggingface_hub's view of the model repos in the cache (CachedRepoInfo), by repo id; none
    where there is no cache yet."""
    import huggingface_hub

    try:
        repos = huggingface_hub.scan_cache_dir(cache_folder()).repos
    except Exception:  # no cache folder yet
        return []
    return sorted((r for r in repos if r.repo_type == "model"), key=lambda r: r.repo_id)


def _snapshot_files(revision) -> dict:
    """A cached revision's files by their path in the repo (CachedFileInfo each)."""
    return {str(f.file_path.relative_to(revision.snapshot_path)): f for f in revision.files}


def cached_names() -> list[str]:
    """The Hub repos with files in the cache, as ORG/REPO."""
    return [r.repo_id for r in _cached_repos()]


def _not_cached(name: HubName, unreachable: Exception | None) -> HubError:
    cached = ", ".join(cached_names()) or "nothing"
    if unreachable is None:
        return HubError(f"{name} is not in the Hub cache and HF_HUB_OFFLINE=1 forbids fetching it (cached: {cached})")
    return HubError(
        f"cannot reach the Hub at {endpoint()} to fetch {name} ({type(unreachable).__name__}: "
        f"{unreachable}); with HF_HUB_OFFLINE=1 tokenloom uses what is cached (cached: {cached})"
    )


def _hub_error(name: HubName, e: Exception) -> HubError:
    """huggingface_hub's (or the system's) exception as a message a user can act on."""
    from huggingface_hub import errors

    page = f"{endpoint()}/{name.repo_id}"
    if isinstance(e, errors.GatedRepoError):
        return HubError(
            f"{name.repo_id} is gated: accept its terms at {page} while logged in, then give a token of "
            "that account in HF_TOKEN (or --hf-token)"
        )
    if isinstance(e, errors.RepositoryNotFoundError):
        return HubError(
            f"no model {name.repo_id} on the Hub ({endpoint()}), and no such local path: check the name; "
            "a private repo needs HF_TOKEN (or --hf-token)"
        )
    if isinstance(e, errors.RevisionNotFoundError):
        return HubError(f"{name.repo_id} has no revision {name.revision!r} ({page})")
    if isinstance(e, errors.LocalEntryNotFoundError):
        return _not_cached(name, None if offline() else e)
    if isinstance(e, OSError) and e.errno == 28:  # ENOSPC
        return HubError(
            f"the disk is full while downloading {name} into {cache_folder()}; the part already "
            "downloaded is kept, and the download resumes from it when you retry after freeing space"
        )
    if _is_network_error(e):
        return _not_cached(name, e)
    return HubError(f"fetching {name} from {endpoint()} failed: {type(e).__name__}: {e}")


def cached_models() -> list[dict]:
    """The Hub models in the cache, one entry per GGUF quant or HF folder: name (as `--model`
    takes it), size in bytes, and where."""
    found = []
    for repo in _cached_repos():
        files = {path: f for rev in repo.revisions for path, f in _snapshot_files(rev).items()}
        for tag, paths in gguf_tags(list(files)).items():
            found.append(_entry(f"{repo.repo_id}:{tag}", [files[p] for p in paths]))
        if "config.json" in files and any(p.endswith(".safetensors") for p in files):
            found.append(_entry(repo.repo_id, [f for p, f in files.items() if not p.endswith(".gguf")]))
    return found


def _entry(name: str, files: list) -> dict:
    return {"name": name, "size": sum(f.size_on_disk for f in files), "path": str(files[0].file_path.parent)}


def remove(text: str) -> list[Path]:
    """Delete Hub model `text` from the cache: one quant's files for ORG/REPO:TAG, the whole repo
    for ORG/REPO; returns what was removed (nothing where it was not cached)."""
    import shutil

    name = parse_name(text)
    if name is None:
        return []
    removed: list[Path] = []
    for repo in (r for r in _cached_repos() if r.repo_id == name.repo_id):
        if not name.tag:
            shutil.rmtree(repo.repo_path)
            removed.append(Path(repo.repo_path))
            continue
        for rev in repo.revisions:
            files = _snapshot_files(rev)
            for path in gguf_tags(list(files)).get(name.tag.upper(), []):
                for gone in (files[path].file_path, files[path].blob_path):
                    Path(gone).unlink(missing_ok=True)
                    removed.append(Path(gone))
    return removed
