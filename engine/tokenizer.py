"""Text to token ids and back for one checkpoint: encoding, chat templates, streaming decode.

``Tokenizer`` reads a Hugging Face checkpoint directory: ``tokenizer.json`` (run by the
``tokenizers`` library), ``tokenizer_config.json`` (special tokens, ``add_bos_token``, chat
template) and ``generation_config.json`` or ``config.json`` (extra end-of-sequence ids).
``IncrementalDetokenizer`` turns one request's output ids into text deltas as they arrive.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import CheckpointError, InvalidRequestError

_INCOMPLETE_CHARACTER = "\ufffd"

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json", "chat_template.jinja")
"""Every file ``Tokenizer.from_dir`` reads: a copy of these tokenizes as the checkpoint does
(the router fetches them from a decode worker instead of loading the checkpoint)."""


@dataclass(frozen=True)
class TokenizerConfig:
    """What a checkpoint says about its tokenizer beyond ``tokenizer.json``."""

    bos_token: str | None = None
    eos_token: str | None = None
    unk_token: str | None = None
    pad_token: str | None = None
    add_bos_token: bool = False
    """Prepend ``bos_token`` on ``encode`` when ``tokenizer.json`` does not already add it."""
    chat_template: str | None = None
    """Jinja source of the chat template, if the model has one."""
    generation_eos_token_ids: tuple[int, ...] = ()
    """End-of-sequence ids from ``generation_config.json`` (else ``config.json``)."""

    @classmethod
    def from_dir(cls, checkpoint_dir: Path) -> TokenizerConfig:
        """Read what is there; every file is optional and a missing one leaves the defaults."""
        raw = _read_json(checkpoint_dir / "tokenizer_config.json")
        eos = _read_json(checkpoint_dir / "generation_config.json").get("eos_token_id")
        if eos is None:
            eos = _read_json(checkpoint_dir / "config.json").get("eos_token_id")
        template_file = checkpoint_dir / "chat_template.jinja"
        chat_template = _chat_template_source(raw.get("chat_template"))
        if chat_template is None and template_file.is_file():
            chat_template = template_file.read_text(encoding="utf-8")
        return cls(
            bos_token=_token_content(raw.get("bos_token")),
            eos_token=_token_content(raw.get("eos_token")),
            unk_token=_token_content(raw.get("unk_token")),
            pad_token=_token_content(raw.get("pad_token")),
            add_bos_token=bool(raw.get("add_bos_token", False)),
            chat_template=chat_template,
            generation_eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        )


class Tokenizer:
    """Encodes, decodes and chat-formats text the way the checkpoint's HF tokenizer does.

    ``encode`` runs ``tokenizer.json`` (special tokens written in the text become their ids) and
    adds BOS when ``tokenizer_config.json`` sets ``add_bos_token`` and ``tokenizer.json`` has not
    added it already.
    """

    def __init__(self, backend: tokenizers.Tokenizer, config: TokenizerConfig) -> None:
        self._backend = backend
        self._config = config
        self._bos_token_id = self._token_id(config.bos_token)
        empty_ids = backend.encode("", add_special_tokens=True).ids
        self._post_processor_adds_bos = self._bos_token_id is not None and empty_ids[:1] == [self._bos_token_id]
        eos_token_id = self._token_id(config.eos_token)
        own_eos = () if eos_token_id is None else (eos_token_id,)
        self._eos_token_ids = frozenset(own_eos + config.generation_eos_token_ids)
        self._chat_template = None if config.chat_template is None else _compile_template(config.chat_template)
        self._byte_level = "ByteLevel" in repr(backend.decoder)
        """Byte-level BPE (GPT-2 style): each piece's characters stand for bytes."""

    @classmethod
    def from_dir(cls, checkpoint_dir: Path) -> Tokenizer:
        """Load from a checkpoint directory; ``CheckpointError`` when ``tokenizer.json`` is missing."""
        checkpoint_dir = Path(checkpoint_dir)
        path = checkpoint_dir / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{checkpoint_dir}: no tokenizer.json")
        text = path.read_text(encoding="utf-8")
        # tokenizers reports every problem as a bare Exception, so the JSON is checked here first.
        try:
            json.loads(text)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path}: not valid JSON ({e})") from e
        backend = tokenizers.Tokenizer.from_str(text)
        return cls(backend, TokenizerConfig.from_dir(checkpoint_dir))

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The tokenizer's EOS id together with every EOS id of the generation config."""
        return self._eos_token_ids

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    def to_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (what a grammar library builds its own from)."""
        return self._backend.to_str()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch, not encode: it lets go of the GIL while it runs, so a long prompt
        # tokenized in a thread does not stall the caller's event loop (same ids)
        token_ids = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens and self._config.add_bos_token and not self._post_processor_adds_bos:
            if self._bos_token_id is not None:
                token_ids = [self._bos_token_id, *token_ids]
        return token_ids

    @property
    def chat_template(self) -> str | None:
        """The chat template's Jinja source (what a tool-call parser is chosen by), if any."""
        return self._config.chat_template

    def chat_prompt_ids(self, messages: Sequence[dict[str, Any]], model_name: str, tools: list[dict] | None = None) -> list[int]:
        """The prompt ids of a chat, as the engine and the router both make them: rendered with the
        generation prompt, then encoded without special tokens (the template wrote its own).
        ``InvalidRequestError`` (field ``messages``) naming ``model_name`` when it has no template."""
        if not self.has_chat_template:
            raise InvalidRequestError("messages", f"model {model_name!r} has no chat template")
        return self.encode(self.apply_chat_template(list(messages), add_generation_prompt=True, tools=tools), add_special_tokens=False)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        """Render ``messages`` (each with a string ``role`` and ``content``) as the prompt text.

        As transformers passes them: ``tools`` (OpenAI tool definitions, ``{"type": "function",
        "function": {"name", "description", "parameters"}}``) as the template's ``tools``, and a
        message's own keys beside role and content (an assistant turn's ``tool_calls`` as
        ``[{"type": "function", "function": {"name", "arguments": dict}}]``, a tool turn's
        ``tool_call_id`` and ``name``) as they are. A template that does not use them ignores them.

        ``InvalidRequestError`` (field ``messages``) when the model has no chat template, a
        message is malformed, or the template rejects the conversation.
        """
        if self._chat_template is None:
            raise InvalidRequestError("messages", "this model has no chat template; send a prompt instead")
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or not all(
                isinstance(message.get(key), str) for key in ("role", "content")
            ):
                raise InvalidRequestError("messages", f"message {index} needs a string 'role' and 'content'")
        try:
            return self._chat_template.render(
                messages=messages,
                tools=tools or None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._config.bos_token or "",
                eos_token=self._config.eos_token or "",
                unk_token=self._config.unk_token or "",
                pad_token=self._config.pad_token or "",
            )
        except jinja2.TemplateError as e:
            raise InvalidRequestError("messages", f"the chat template rejected the conversation: {e}") from e

    def token_text(self, token_id: int) -> str:
        """One token's text alone, special tokens included (a piece of a character is U+FFFD)."""
        return self._backend.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """One token's bytes: a byte-level BPE piece's raw bytes, a ``<0xNN>`` fallback piece's
        byte, else the UTF-8 of its text (so a piece of a multi-byte character keeps its bytes)."""
        piece = self._backend.id_to_token(token_id)
        if piece is not None:
            if _BYTE_FALLBACK.fullmatch(piece):
                return bytes([int(piece[3:5], 16)])
            if self._byte_level and all(c in _UNICODE_TO_BYTE for c in piece):
                return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        return self.token_text(token_id).encode("utf-8")

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas as they are generated.

    Each step decodes only a short window of ids, never the whole output:

        ids:   ... prompt ... | output ...................................
                          [ prefix window  | new ids ]
        delta = decode(prefix window + new ids) - decode(prefix window)

    Decoding with a few earlier ids in front keeps the leading space a byte-level or
    sentencepiece decoder would drop at the start of a text. Text that ends in U+FFFD (an
    incomplete UTF-8 character, its bytes split over several tokens) is held back until the
    character is complete. Call ``flush`` when the request finishes; the concatenation of every
    delta is then ``tokenizer.decode(output ids)``.
    """

    _NUM_PREFIX_TOKENS = 5

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._window_ids = list(prompt_token_ids[-self._NUM_PREFIX_TOKENS :])
        self._num_prefix_ids = len(self._window_ids)
        self._prefix_text = self._decode(self._window_ids)
        self._num_held_chars_emitted = 0

    def add_tokens(self, new_token_ids: Sequence[int]) -> str:
        """The text that ``new_token_ids`` complete; empty while a character is still partial."""
        self._window_ids.extend(new_token_ids)
        text = self._decode(self._window_ids)
        if text.endswith(_INCOMPLETE_CHARACTER):
            complete = text.rstrip(_INCOMPLETE_CHARACTER)
            delta = complete[len(self._prefix_text) + self._num_held_chars_emitted :]
            self._num_held_chars_emitted += len(delta)
            return delta
        delta = text[len(self._prefix_text) + self._num_held_chars_emitted :]
        if len(text) > len(self._prefix_text):
            self._slide_window()
        return delta

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end, as U+FFFD)."""
        text = self._decode(self._window_ids)
        delta = text[len(self._prefix_text) + self._num_held_chars_emitted :]
        self._slide_window()
        return delta

    def _slide_window(self) -> None:
        self._window_ids = self._window_ids[self._num_prefix_ids :]
        self._num_prefix_ids = len(self._window_ids)
        self._prefix_text = self._decode(self._window_ids)
        self._num_held_chars_emitted = 0

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the rest are shifted
    past U+0100."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, shift = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + shift)
            shift += 1
    return mapping


_UNICODE_TO_BYTE = {c: b for b, c in _byte_to_unicode().items()}
_BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e


def _token_content(token: str | dict[str, Any] | None) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _chat_template_source(template: str | list[dict[str, str]] | None) -> str | None:
    if isinstance(template, list):  # named templates; "default" is the one for plain chat
        named = {entry["name"]: entry["template"] for entry in template}
        return named.get("default")
    return template


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.cache
def _jinja_environment() -> ImmutableSandboxedEnvironment:
    # The settings transformers renders chat templates with, so prompts match byte for byte.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _compile_template(source: str) -> jinja2.Template:
    try:
        return _jinja_environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise CheckpointError(f"the chat template does not compile: {e}") from e
