"""Long texts tokenized in a child process, so that the server's GIL never waits on them.

Why a process: tokenizing itself lets go of the GIL (Tokenizer.encode), but freeing a 4 MB
prompt's Encoding (1.1M token strings) holds it, and the prepare worker that holds it runs at
nice 10: beside two busy threads (the engine's decode) the free took many times its CPU time,
and the event loop waited for the GIL all that time (/health answered late; docs/BENCHMARKS.md,
'Measurements behind design choices'). In a child,
the server's threads never wait on a long text; the child runs at nice 10 as the workers do.

This file is also the child: ``python -I long_texts.py`` (run by path, so that it imports the
tokenizers package and the standard library only, not tokenloom and torch). Protocol over the
child's stdin/stdout, little-endian: first the tokenizer (u32 length, its JSON); then per text
a request (u32 text bytes, i64 limit or -1, u8 add_special_tokens, the UTF-8 text) and an
answer (u8 status, i64 n; status 0: n int32 ids follow, 1: the text has n tokens, more than
the limit, 2: n bytes of an error message follow).
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import threading
from array import array

REQUEST, ANSWER, LENGTH = struct.Struct("<IqB"), struct.Struct("<Bq"), struct.Struct("<I")
IDS, TOO_MANY, ERROR = 0, 1, 2


class TokenizerProcess:
    """One child process holding a copy of the tokenizer (`tokenizer_json`: UTF-8 of what
    ``tokenizers.Tokenizer.to_str`` gives), started on first use. One caller at a time."""

    def __init__(self, tokenizer_json: bytes) -> None:
        self.tokenizer_json = tokenizer_json
        self.child: subprocess.Popen | None = None

    def encode(self, text: str, add_special_tokens: bool, limit: int | None) -> tuple[list[int] | None, int]:
        """(ids, count) of `text`, or (None, count) when count > `limit`; a child that died is
        started again once (RuntimeError if the new one fails too)."""
        for attempt in range(2):
            try:
                return self._ask(text, add_special_tokens, limit)
            except (OSError, EOFError) as e:
                self.close()
                if attempt:
                    raise RuntimeError(f"the tokenizer process failed: {e}") from None
        raise AssertionError("unreachable")

    def _ask(self, text: str, add_special_tokens: bool, limit: int | None) -> tuple[list[int] | None, int]:
        child = self._started()
        assert child.stdin is not None and child.stdout is not None  # opened with PIPE
        data = text.encode("utf-8", "surrogatepass")
        child.stdin.write(REQUEST.pack(len(data), -1 if limit is None else limit, add_special_tokens))
        child.stdin.write(data)  # not joined to the header: no copy of megabytes
        child.stdin.flush()
        status, n = ANSWER.unpack(_read(child.stdout, ANSWER.size))
        if status == TOO_MANY:
            return None, n
        if status == ERROR:
            raise ValueError(_read(child.stdout, n).decode())
        ids = array("i")
        ids.frombytes(_read(child.stdout, 4 * n))
        return ids.tolist(), n

    def _started(self) -> subprocess.Popen:
        if self.child is None:
            self.child = subprocess.Popen(
                [sys.executable, "-I", __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE
            )
            assert self.child.stdin is not None  # opened with PIPE
            self.child.stdin.write(LENGTH.pack(len(self.tokenizer_json)) + self.tokenizer_json)
            self.child.stdin.flush()
        return self.child

    def close(self) -> None:
        if self.child is not None:
            self.child.kill()
            self.child.wait()
            self.child = None


class LongTexts:
    """Tokenizes texts of over tokenizer.LONG_TEXT characters (those it lets go of the GIL for) in
    TokenizerProcesses, one per calling thread (two workers' long prompts run side by side);
    shorter ones with `tokenizer` in the thread (a few milliseconds)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        # at start-up, not in a nice-10 worker: to_str holds the GIL, far longer when starved of CPU
        self.tokenizer_json = tokenizer.backend.to_str().encode()
        self.local = threading.local()
        self.processes: list[TokenizerProcess] = []
        self.lock = threading.Lock()

    def encode(self, text: str, add_special_tokens: bool = True, limit: int | None = None) -> list[int]:
        """As Tokenizer.encode (the same ids; TooManyTokens past `limit`)."""
        from tokenloom.tokenizer import LONG_TEXT, TooManyTokens

        if len(text) <= LONG_TEXT:
            return self.tokenizer.encode(text, add_special_tokens, limit=limit)
        ids, count = self._process().encode(text, add_special_tokens, limit)
        if ids is None:
            assert limit is not None  # only a limit makes the process answer TOO_MANY
            raise TooManyTokens(count, limit)
        return ids

    def _process(self) -> TokenizerProcess:
        process = getattr(self.local, "process", None)
        if process is None:
            process = self.local.process = TokenizerProcess(self.tokenizer_json)
            with self.lock:
                self.processes.append(process)
        return process

    def close(self) -> None:
        """End every child process (the server's shutdown)."""
        with self.lock:
            for process in self.processes:
                process.close()


def _read(stream, size: int) -> bytes:
    data = stream.read(size)
    if len(data) != size:
        raise EOFError(f"the tokenizer process ended (read {len(data)} of {size} bytes)")
    return data


def _serve(stdin, stdout) -> None:
    """The child: answer requests until stdin closes (the server ended or closed it)."""
    from tokenizers import Tokenizer

    os.nice(10)
    (size,) = LENGTH.unpack(_read(stdin, LENGTH.size))
    tokenizer = Tokenizer.from_str(_read(stdin, size).decode())
    while header := stdin.read(REQUEST.size):
        size, limit, add_special = REQUEST.unpack(header)
        text = _read(stdin, size).decode("utf-8", "surrogatepass")
        try:  # Tokenizer.encode's long-text path (tokenloom itself is not imported here: torch)
            encoding = tokenizer.encode_batch_fast([text], add_special_tokens=bool(add_special))[0]
        except Exception as e:
            message = f"{type(e).__name__}: {e}".encode()
            stdout.write(ANSWER.pack(ERROR, len(message)) + message)
        else:
            if 0 <= limit < len(encoding):
                stdout.write(ANSWER.pack(TOO_MANY, len(encoding)))
            else:
                stdout.write(ANSWER.pack(IDS, len(encoding)) + array("i", encoding.ids).tobytes())
        stdout.flush()


if __name__ == "__main__":
    _serve(sys.stdin.buffer, sys.stdout.buffer)
