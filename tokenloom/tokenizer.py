"""Text <-> token ids (HF ``tokenizers``) and chat templates (jinja2).

The chat template is rendered the way transformers renders it: a sandboxed
jinja2 environment with ``trim_blocks``/``lstrip_blocks``, ``raise_exception``
and ``tojson``, given ``messages``, ``add_generation_prompt`` and the special tokens.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer as HFTokenizer

if TYPE_CHECKING:
    import jinja2


class ChatTemplateError(ValueError):
    """The model has no chat template, or the template rejected the messages."""


class TooManyTokens(ValueError):
    """A text of more tokens than the limit given to Tokenizer.encode; ``count`` is how many."""

    def __init__(self, count: int, limit: int) -> None:
        super().__init__(f"the text has {count} tokens, more than {limit}")
        self.count = count


LONG_TEXT = 16_384  # characters; above this, encoding releases the GIL (Tokenizer.encode)


def _raise_exception(message: str):
    raise ChatTemplateError(f"chat template error: {message}")


def compile_chat_template(source: str) -> jinja2.Template:
    import jinja2.ext  # here, not at the top: a run without a chat prompt never loads jinja2
    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x.json_value() if hasattr(x, "json_value") else x, indent=indent, ensure_ascii=ensure_ascii
    )  # json_value: JSON text that stands for the value it holds (tool_calling.messages.JSONText)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the model's chat template does not compile: {e} (line {e.lineno})") from None


def template_takes_system(source: str | None) -> bool:
    """Whether a chat template renders a system message: False where it refuses one (Gemma 2's
    raises) or leaves its text out. A template that fails on this probe for any other reason, or
    no template, counts as taking it (nothing is changed for it)."""
    if not source:
        return True
    probe = [{"role": "system", "content": "SYSTEM-PROBE"}, {"role": "user", "content": "hi"}]
    try:
        text = compile_chat_template(source).render(
            messages=probe, add_generation_prompt=True, bos_token="", eos_token=""
        )
    except ChatTemplateError as e:
        return "system" not in str(e).lower()
    except Exception:
        return True
    return "SYSTEM-PROBE" in text


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json spells special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _load_backend(folder: Path) -> HFTokenizer:
    """tokenizer.json, or GPT-2 style vocab.json + merges.txt (byte-level BPE)."""
    if (folder / "tokenizer.json").is_file():
        return HFTokenizer.from_file(str(folder / "tokenizer.json"))
    vocab, merges = folder / "vocab.json", folder / "merges.txt"
    if vocab.is_file() and merges.is_file():
        from tokenizers import decoders, models, pre_tokenizers

        tk = HFTokenizer(models.BPE.from_file(str(vocab), str(merges)))
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tk.decoder = decoders.ByteLevel()
        if tk.token_to_id("<|endoftext|>") is not None:
            tk.add_special_tokens(["<|endoftext|>"])
        return tk
    raise FileNotFoundError(f"{folder} has no tokenizer.json (nor GPT-2 style vocab.json + merges.txt)")


def _tokenizer_config(folder: Path) -> dict:
    config_path = folder / "tokenizer_config.json"
    return json.loads(config_path.read_text()) if config_path.is_file() else {}


def folder_chat_template(folder: str | Path, config: dict | None = None) -> str | None:
    """An HF folder's chat template: tokenizer_config.json's (its default one where it names
    several), else chat_template.jinja; None where it has none. Reads no vocabulary."""
    folder = Path(folder)
    template = (config if config is not None else _tokenizer_config(folder)).get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    jinja_path = folder / "chat_template.jinja"
    if template is None and jinja_path.is_file():
        template = jinja_path.read_text()
    return template


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus what generation needs from tokenizer_config.json."""

    def __init__(
        self,
        backend: HFTokenizer,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._compiled: jinja2.Template | None = None  # chat_template compiled at its first use

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        """Load tokenizer.json (+ tokenizer_config.json / chat_template.jinja) from an HF folder."""
        folder = Path(folder)
        backend = _load_backend(folder)
        config = _tokenizer_config(folder)
        return cls(
            backend,
            folder_chat_template(folder, config),
            _token_text(config.get("bos_token")),
            _token_text(config.get("eos_token")),
        )

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True, limit: int | None = None) -> list[int]:
        """Token ids of `text`. Long texts go through encode_batch_fast, which lets go of the GIL while
        it works and keeps no offsets (encode holds the GIL for the whole text, freezing every other
        thread; encode_batch's full Encoding holds it again while it is freed); the same ids.
        With `limit`, a text of more tokens raises TooManyTokens before its ids become a Python list
        (a 4 MB prompt's 1.1M ids hold the GIL to build and again to free; figures in
        docs/BENCHMARKS.md, 'Measurements behind design choices')."""
        if len(text) > LONG_TEXT:
            encoding = self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0]
        else:
            encoding = self.backend.encode(text, add_special_tokens=add_special_tokens)
        if limit is not None and len(encoding) > limit:
            raise TooManyTokens(len(encoding), limit)
        return encoding.ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render a conversation into the prompt text the model was trained on."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; use a plain prompt instead")
        if self._compiled is None:
            self._compiled = compile_chat_template(self.chat_template)
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ChatTemplateError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
        return self._compiled.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )

    def encode_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        """Chat prompt ids; special tokens come from the template text, not added again."""
        return self.encode(self.apply_chat_template(messages, **kwargs), add_special_tokens=False)

    def save(self, folder: str | Path, add_bos_token: bool = False) -> None:
        """Write tokenizer.json and tokenizer_config.json into an HF-style folder."""
        folder = Path(folder)
        self.backend.save(str(folder / "tokenizer.json"))
        config = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "add_bos_token": add_bos_token,
            "chat_template": self.chat_template,
            "tokenizer_class": "PreTrainedTokenizerFast",
        }
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
