"""Records tokenized: every record once, as a :class:`Document` of tokens and loss mask.

Every document is tokenized by ``--tokenizer`` (default: bytes, see
:mod:`plait.train.tokenizer`): a text document is the tokenizer's bos (if it has one), the
text's tokens and its eos (if it has one), every token a target. A chat is rendered with
the chat template (``--chat-template``, else the tokenizer's; the byte tokenizer has a
plain one) and ends with the eos; only its assistant answers are targets. An answer is
told by rendering the conversation before the assistant turn with
``add_generation_prompt=True`` and through that turn: the tokens between are the answer
(the template's own closing of the turn, like ChatML's ``<|im_end|>``, included). Both
renderings must tokenize to prefixes of the whole conversation's tokens, else the chat is
refused (the answer could not be told apart).

Each document also carries a short hash of its record's content, which the validation
split ranks documents by (:mod:`plait.train.token_data`), so the split does not depend on
the files' order.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from plait.train.config import ConfigError
from plait.train.sources import Record
from plait.train.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, render_chat

__all__ = ["Document", "tokenize_records"]

_ENCODE_CHUNK = 1024  # documents a Hugging Face tokenizer encodes per call


@dataclass
class Document:
    """One tokenized document (or a piece of one)."""

    tokens: torch.Tensor  # (n,) uint8 (bytes) or int32 ids
    # (n,) bool: whether each token takes loss as a target; None: every token does
    trained: torch.Tensor | None
    key: bytes  # 8 bytes: a hash of the content, for the validation split (_key)


def _key(record: Record) -> bytes:
    return hashlib.blake2b(record.key, digest_size=8).digest()


def _encode_texts(tok: Tokenizer, texts: list[str]) -> list[torch.Tensor]:
    """Each text's ids, without bos or eos: bytes (uint8) straight from the buffer, a
    Hugging Face tokenizer's (int32) in batches."""
    if isinstance(tok, ByteTokenizer):
        return [
            torch.frombuffer(bytearray(t.encode("utf-8")), dtype=torch.uint8)
            if t
            else torch.zeros(0, dtype=torch.uint8)
            for t in texts
        ]
    if isinstance(tok, HFTokenizer):
        out: list[torch.Tensor] = []
        for i in range(0, len(texts), _ENCODE_CHUNK):
            ids = tok.encode_batch(texts[i : i + _ENCODE_CHUNK])
            out.extend(torch.tensor(x, dtype=torch.int32) for x in ids)
        return out
    return [torch.tensor(tok.encode(t), dtype=torch.int32) for t in texts]


def _chat(tok: Tokenizer, template: str, record: Record) -> tuple[list[int], list[bool]]:
    """A chat's tokens, and which are targets: its assistant answers."""
    messages = record.messages
    assert messages is not None
    whole = tok.encode(render_chat(template, messages, False, tok))
    trained = [False] * len(whole)
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tok.encode(render_chat(template, messages[:turn], True, tok))
        through = tok.encode(render_chat(template, messages[: turn + 1], False, tok))
        start, end = len(before), len(through)
        if start > end or whole[:start] != before or whole[:end] != through:
            raise ConfigError(
                f"--data {record.where}: the chat template's rendering of the conversation "
                f"before assistant turn {turn} (with add_generation_prompt) or through it "
                "does not tokenize to a prefix of the whole conversation's tokens, so the "
                "answer cannot be told apart from the prompt: use a chat template "
                "(--chat-template) whose turns end at a token boundary"
            )
        trained[start:end] = [True] * (end - start)
    return whole, trained


def tokenize_records(records: list[Record], tok: Tokenizer, template: str | None) -> list[Document]:
    """Every record as a document (empty texts dropped)."""
    texts = [r.text for r in records if r.text is not None]
    encoded = iter(_encode_texts(tok, texts))
    bos = [tok.bos_id] if tok.bos_id is not None else []
    eos = [tok.eos_id] if tok.eos_id is not None else []
    docs = []
    for record in records:
        if record.text is not None:
            body = next(encoded)
            if not len(body):
                continue
            if bos or eos:
                ends = (torch.tensor(x, dtype=body.dtype) for x in (bos, eos))
                body = torch.cat([next(ends), body, next(ends)])
            trained = None
        else:
            if template is None:
                raise ConfigError(
                    f"--data {record.where}: a chat, but the tokenizer {tok.name} has no "
                    "chat_template (tokenizer_config.json): give one with --chat-template"
                )
            ids, mask = _chat(tok, template, record)
            dtype = torch.uint8 if isinstance(tok, ByteTokenizer) else torch.int32
            body = torch.tensor(ids + eos, dtype=dtype)
            trained = torch.tensor(mask + [False] * len(eos), dtype=torch.bool)
        if len(body):  # an empty document would number no token
            docs.append(Document(body, trained, _key(record)))
    return docs
