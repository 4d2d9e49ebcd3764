"""Tokenizers for ``plait train``: bytes (no file needed), or a Hugging Face ``tokenizer.json``.

:func:`load_tokenizer` turns ``--tokenizer``'s value into a :class:`Tokenizer`: ``""`` is
:class:`ByteTokenizer` (ids are the UTF-8 bytes, vocabulary 256, as plait train always
had), anything else a ``tokenizer.json`` read with the ``tokenizers`` library
(:class:`HFTokenizer`), with the ``tokenizer_config.json`` beside it, when there is one,
giving the chat template and the beginning- and end-of-sequence tokens.

:func:`train_bpe` is ``plait tokenizer train``: a byte-level BPE trained on the same files
``plait train --data`` reads, with the special tokens ``<|endoftext|>`` (end of a
document: the eos), ``<|im_start|>`` and ``<|im_end|>`` (ChatML turns), written as a
``tokenizer.json`` and a ``tokenizer_config.json`` holding a ChatML chat template (the
command itself, reading ``--data``, is :mod:`plait.train.tokenizer_command`).

The optional libraries (``tokenizers``, ``jinja2``) are imported inside the functions
that need them, so plain byte-level training needs neither.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from plait.train.config import ConfigError
from plait.train.extras import require

__all__ = [
    "BYTE_CHAT_TEMPLATE",
    "CHATML_TEMPLATE",
    "ENDOFTEXT",
    "IM_END",
    "IM_START",
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "load_tokenizer",
    "render_chat",
    "train_bpe",
]

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

#: The byte tokenizer's chat template: plain text, one ``role: content`` paragraph per
#: turn; the generation prompt is ``assistant: ``, so an answer is its content and the
#: blank line after it (the byte tokenizer has no end-of-sequence token to stop on).
BYTE_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n\n"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)

#: ChatML, as ``plait tokenizer train`` writes it: each turn is ``<|im_start|>role\n``,
#: the content and ``<|im_end|>\n``; an answer is its content and ``<|im_end|>\n``.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@runtime_checkable
class Tokenizer(Protocol):
    """What ``plait train`` and ``plait sample`` need of a tokenizer."""

    name: str  # one line: what it is (for messages and the run's data description)
    vocab_size: int  # ids are in 0 .. vocab_size - 1
    eos_id: int | None  # ends every document (None: the tokenizer has none)
    bos_id: int | None  # begins every text document (None: none)
    bos_token: str  # their text, for chat templates ("" when None)
    eos_token: str
    chat_template: str | None  # a Jinja template of a list of messages (None: none)

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``, special tokens written in it included, with no
        beginning or end added."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` (special tokens shown as written)."""
        ...


class ByteTokenizer:
    """Ids are the UTF-8 bytes of the text: vocabulary 256, no special tokens. Decoding
    replaces invalid UTF-8 (a sample may stop inside a character) with U+FFFD."""

    name = "bytes"
    vocab_size = 256
    eos_id: int | None = None
    bos_id: int | None = None
    bos_token = ""
    eos_token = ""
    chat_template: str | None = BYTE_CHAT_TEMPLATE

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (the ``tokenizers`` library) and, when present,
    the ``tokenizer_config.json`` beside it (``chat_template``, ``bos_token``,
    ``eos_token``: strings or ``{"content": ...}``).

    Encoding adds no special tokens of its own (a template's post-processor, e.g. a
    Llama's beginning-of-sequence, is left out: :attr:`bos_id` says what to add), but the
    special tokens written in the text (a chat template's ``<|im_start|>``) become their ids.
    """

    def __init__(self, path: str) -> None:
        tokenizers = require("tokenizers", "--tokenizer")
        file = Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise ConfigError(f"--tokenizer {path}: no such file (a tokenizer.json, or its folder)")
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(file))
        except Exception as err:  # the library raises plain Exceptions for bad files
            raise ConfigError(
                f"--tokenizer {file}: not a tokenizers tokenizer.json: {err}"
            ) from err
        self.name = str(file)
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        settings = _read_settings(file.parent / "tokenizer_config.json")
        self.chat_template = _template_of(settings.get("chat_template"), file)
        self.bos_token = _token_text(settings.get("bos_token"))
        self.eos_token = _token_text(settings.get("eos_token"))
        self.bos_id = self._id_of(self.bos_token, "bos_token", file)
        self.eos_id = self._id_of(self.eos_token, "eos_token", file)

    def _id_of(self, token: str, key: str, file: Path) -> int | None:
        if not token:
            return None
        found = self._tok.token_to_id(token)
        if found is None:
            raise ConfigError(
                f"--tokenizer {file}: tokenizer_config.json's {key} {token!r} is not in the "
                "tokenizer's vocabulary: fix or remove the key"
            )
        return int(found)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """:meth:`encode` of each text (in parallel, in the library's threads)."""
        return [list(e.ids) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=False))


def load_tokenizer(path: str) -> Tokenizer:
    """``--tokenizer``'s tokenizer: ``""`` bytes, else the ``tokenizer.json`` at ``path``
    (or in the folder ``path``)."""
    return HFTokenizer(path) if path else ByteTokenizer()


def _read_settings(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ConfigError(f"--tokenizer: {path} is not readable JSON: {err}") from err
    if not isinstance(values, dict):
        raise ConfigError(f"--tokenizer: {path} is not a JSON object")
    return values


def _token_text(value: Any) -> str:
    """A special token as tokenizer_config.json writes it: a string, an AddedToken's
    ``{"content": ...}``, or null."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _template_of(value: Any, file: Path) -> str | None:
    """tokenizer_config.json's ``chat_template``: a string, or a list of named templates
    (``[{"name": "default", "template": ...}]``, of which the default is taken)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default")
        if isinstance(chosen, str):
            return chosen
    raise ConfigError(
        f"--tokenizer {file}: tokenizer_config.json's chat_template is neither a template "
        "nor a list holding a 'default' one: give one with --chat-template"
    )


# ----------------------------------------------------------------------------------------
# Chat templates
# ----------------------------------------------------------------------------------------


def render_chat(
    template: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    tokenizer: Tokenizer,
) -> str:
    """``messages`` rendered with the Jinja ``template``, in a sandbox (a template from a
    downloaded tokenizer must not reach Python's internals). The template sees
    ``messages``, ``add_generation_prompt``, ``bos_token`` and ``eos_token``, and may call
    ``raise_exception(text)``. ConfigError for a template that does not parse or render."""
    compiled = _compile(template)
    try:
        return str(
            compiled.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=tokenizer.bos_token,
                eos_token=tokenizer.eos_token,
            )
        )
    except _TemplateRefused as err:
        raise ConfigError(f"the chat template refused a conversation: {err}") from err
    except Exception as err:  # jinja2's errors: undefined names, sandbox violations
        raise ConfigError(f"the chat template failed to render: {err}") from err


class _TemplateRefused(Exception):
    pass


def _raise_exception(message: str) -> None:
    raise _TemplateRefused(message)


_COMPILED: dict[str, Any] = {}


def _compile(template: str) -> Any:
    if template in _COMPILED:
        return _COMPILED[template]
    require("jinja2", "a chat template")
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # Hugging Face's conventions for chat templates: blocks trim their newline.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    try:
        compiled = env.from_string(template)
    except TemplateError as err:
        raise ConfigError(f"the chat template is not a valid Jinja template: {err}") from err
    _COMPILED[template] = compiled
    return compiled


# ----------------------------------------------------------------------------------------
# plait tokenizer train
# ----------------------------------------------------------------------------------------


def train_bpe(texts: Iterable[str], vocab: int, out: str) -> HFTokenizer:
    """Train a byte-level BPE of ``vocab`` ids (the 256 bytes, the special tokens
    ``<|endoftext|>``, ``<|im_start|>`` and ``<|im_end|>``, then merges) on ``texts``;
    write it to ``out`` (a ``tokenizer.json``) with a ``tokenizer_config.json`` beside it
    (ChatML template, eos ``<|endoftext|>``, no bos), and return it loaded."""
    specials = [ENDOFTEXT, IM_START, IM_END]
    least = 256 + len(specials)
    if vocab < least:
        raise ConfigError(
            f"--vocab {vocab}: a byte-level BPE holds the 256 bytes and {len(specials)} "
            f"special tokens: use --vocab {least} or more"
        )
    tokenizers = require("tokenizers", "plait tokenizer train")
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=specials,  # ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: nothing unknown
        show_progress=False,
    )
    counted = _Counted(texts)
    tok.train_from_iterator(counted, trainer=trainer)
    if not counted.n:
        raise ConfigError("--data: no text to train the tokenizer on")
    target = Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(target))
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": ENDOFTEXT,
        "pad_token": ENDOFTEXT,
        "chat_template": CHATML_TEMPLATE,
        "added_by": "plait tokenizer train",
    }
    (target.parent / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
    return HFTokenizer(str(target))


class _Counted:
    """An iterable of texts that counts what it gave."""

    def __init__(self, texts: Iterable[str]) -> None:
        self.texts = texts
        self.n = 0

    def __iter__(self) -> Iterator[str]:
        for text in self.texts:
            self.n += 1
            yield text
