"""A local server that speaks the parts of the Hugging Face Hub's HTTP API that huggingface_hub uses
to find and download a model's files, for tests (the real Hub cannot be reached from CI).

Routes, as the Hub answers them:
- ``GET /api/models/{org}/{repo}`` and ``.../revision/{rev}``: model info (sha, siblings, gated);
- ``GET /api/models/{org}/{repo}/tree/{rev}``: the file tree (path, size, oid);
- ``HEAD|GET /{org}/{repo}/resolve/{rev}/{path}``: a file, with ``ETag``, ``X-Repo-Commit`` and
  ``Range`` requests (206 + ``Content-Range``).
Errors carry the Hub's ``X-Error-Code`` (RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo):
a gated repo lists its files to anyone but answers a file request 401 without a token
(``Authorization: Bearer ...``) and 403 with a wrong one.

``cut_after[(repo, path)] = n`` makes the next download of that file stop after n bytes (the
connection closes mid-body, as a dropped network would), once; ``requests`` records each file
request's method, path and Range header.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


@dataclass
class Repo:
    files: dict[str, bytes]
    gated_token: str | None = None  # the token that opens a gated repo; None: public
    sha: str = field(default="")
    tags: tuple[str, ...] = ()  # revisions besides "main" and the sha that name this commit (v1.0)

    def __post_init__(self) -> None:
        digest = hashlib.sha1(b"".join(p.encode() + hashlib.sha1(b).digest() for p, b in sorted(self.files.items())))
        self.sha = self.sha or digest.hexdigest()

    @classmethod
    def from_folder(cls, folder: Path, **kwargs) -> Repo:
        files = {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        return cls(files, **kwargs)


def _error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status, headers={"X-Error-Code": code, "X-Error-Message": message})


def _etag(data: bytes) -> str:
    return '"' + hashlib.sha256(data).hexdigest() + '"'


class FakeHub:
    """``FakeHub({"org/name": Repo(...)}).app`` is the ASGI app (serve it with ThreadedServer)."""

    def __init__(self, repos: dict[str, Repo]) -> None:
        self.repos = repos
        self.cut_after: dict[tuple[str, str], int] = {}
        self.requests: list[tuple[str, str, str | None]] = []
        self.app = FastAPI()
        self.app.add_api_route("/api/models/{org}/{name}", self.info, methods=["GET"])
        self.app.add_api_route("/api/models/{org}/{name}/revision/{rev}", self.info, methods=["GET"])
        self.app.add_api_route("/api/models/{org}/{name}/tree/{rev}", self.tree, methods=["GET"])
        self.app.add_api_route("/{org}/{name}/resolve/{rev}/{path:path}", self.resolve, methods=["GET", "HEAD"])

    def _open(self, request: Request, org: str, name: str, rev: str, files: bool = False) -> Repo | JSONResponse:
        """The repo, or the Hub's error; a gated repo's files (not its listing) need its token."""
        repo = self.repos.get(f"{org}/{name}")
        if repo is None:
            return _error(404, "RepoNotFound", f"Repository {org}/{name} not found")
        if files and repo.gated_token is not None:
            given = request.headers.get("authorization", "")
            if not given:
                return _error(401, "GatedRepo", f"Access to model {org}/{name} is restricted. Please log in.")
            if given != f"Bearer {repo.gated_token}":
                return _error(403, "GatedRepo", f"Access to model {org}/{name} is restricted to authorized users.")
        if rev not in ("main", repo.sha, *repo.tags):
            return _error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return repo

    def info(self, request: Request, org: str, name: str, rev: str = "main"):
        repo = self._open(request, org, name, rev)
        if isinstance(repo, JSONResponse):
            return repo
        return {
            "id": f"{org}/{name}",
            "modelId": f"{org}/{name}",
            "sha": repo.sha,
            "private": False,
            "gated": "manual" if repo.gated_token else False,
            "siblings": [{"rfilename": p} for p in repo.files],
        }

    def tree(self, request: Request, org: str, name: str, rev: str):
        repo = self._open(request, org, name, rev)
        if isinstance(repo, JSONResponse):
            return repo
        entries = [
            {"type": "file", "path": p, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
            for p, b in repo.files.items()
        ]
        folders = sorted({str(Path(p).parent) for p in repo.files} - {"."})
        return [{"type": "directory", "path": f, "oid": "0" * 40, "size": 0} for f in folders] + entries

    def resolve(self, request: Request, org: str, name: str, rev: str, path: str):
        repo = self._open(request, org, name, rev, files=True)
        if isinstance(repo, JSONResponse):
            return repo
        self.requests.append((request.method, path, request.headers.get("range")))
        data = repo.files.get(path)
        if data is None:
            return _error(404, "EntryNotFound", f"{path} does not exist on {rev}")
        headers = {"ETag": _etag(data), "X-Repo-Commit": repo.sha, "Accept-Ranges": "bytes"}
        start = 0
        if (spec := request.headers.get("range", "")).startswith("bytes="):
            start = int(spec[6:].split("-")[0] or 0)
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        body = data[start:]
        headers["Content-Length"] = str(len(body))
        status = 206 if start else 200
        if request.method == "HEAD":
            return Response(status_code=status, headers=headers)
        cut = self.cut_after.pop((f"{org}/{name}", path), None)
        if cut is None:
            return Response(body, status, headers=headers, media_type="application/octet-stream")

        async def cut_short():
            yield body[:cut]
            raise ConnectionError("the fake Hub drops the connection mid-file")

        return StreamingResponse(cut_short(), status, headers=headers, media_type="application/octet-stream")
