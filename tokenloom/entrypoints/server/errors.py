"""The error a request handler raises for the client to see, as OpenAI's error JSON.

Apart from protocol.py (pydantic) so that admission.py, which the CLI reads for serve's flag
defaults on every command, imports without the server's stack."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error the client caused or must see, rendered as OpenAI's error JSON."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers or {}

    def renamed(self, names: dict[str, str]) -> APIError:
        """The same error told in another API's parameter names (`names`: ours -> theirs)."""
        message, param = self.message, self.param
        for ours, theirs in names.items():
            message = message.replace(f"{ours} ", f"{theirs} ")
            param = theirs if param == ours else param
        return APIError(self.status, message, param, self.type, self.code, self.headers)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
