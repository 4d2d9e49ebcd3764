"""``plait train``'s data side: tokenizers (bytes, a locally trained BPE), the record
kinds (text, JSON lines, Parquet, chats), packing into rows with document indices and loss
masks, batches as pure functions of the step, and the refusals.

Everything is built here from a few standard-library files: nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shutil
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from plait.train import data as data_module
from plait.train.cli import main
from plait.train.config import ConfigError, TrainConfig
from plait.train.data import (
    IGNORE,
    Batch,
    TokenData,
    load_data,
    record_fingerprint,
)
from plait.train.resolve import resolve
from plait.train.tokenizer import (
    CHATML_TEMPLATE,
    ENDOFTEXT,
    IM_END,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
    train_bpe,
)

from harness import run_on_ranks

STDLIB = Path(sysconfig.get_paths()["stdlib"])
BPE_FILES = ("bisect.py", "colorsys.py", "keyword.py")  # small, stable, plain ASCII


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    """A byte-level BPE of 400 ids trained on a few standard-library files."""
    out = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    texts = [(STDLIB / name).read_text() for name in BPE_FILES]
    return train_bpe(texts, 400, str(out))


def _jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


#: Ten documents of distinct letters: the packed rows can be checked by hand.
TEXTS = [chr(ord("a") + i) * (5 + i) for i in range(10)]


def _config(data: Path, **changes: Any) -> TrainConfig:
    return TrainConfig(data=str(data), seq_len=8, **changes)


def _split_docs(data: TokenData, split: str) -> list[list[int]]:
    """The documents of ``split``, in their stored order, as lists of ids."""
    part = data.splits[split]
    return [part.document(i).tolist() for i in range(part.n_docs)]


def _stream_rows(data: TokenData, split: str, epoch: int, rows: range) -> list[int]:
    """Which rows of ``epoch``'s stream the epoch's ``rows``-th taken rows are (its row
    order is a permutation of the stream's rows)."""
    taken = data.splits[split].epoch(epoch)[2].tolist()
    assert sorted(taken) == list(range(data.rows_per_epoch(split)))
    return [taken[r] for r in rows]


def _expected_rows(data: TokenData, split: str, epoch: int, rows: range) -> list[list[int]]:
    """Rows of ``seq_len + 1`` tokens, ``seq_len`` apart, of the documents of ``split`` in
    ``epoch``'s order, concatenated; the ``rows``-th the epoch takes."""
    docs = _split_docs(data, split)
    order = data.splits[split].epoch(epoch)[0]
    assert sorted(order.tolist()) == list(range(len(docs)))  # a permutation
    stream = [t for i in order.tolist() for t in docs[i]]
    t = data.seq_len
    return [stream[r * t : r * t + t + 1] for r in _stream_rows(data, split, epoch, rows)]


def _document_index(data: TokenData, split: str, epoch: int, rows: range) -> list[list[int]]:
    """For each row's input positions, the document (counted from the row's first) it is in."""
    docs = _split_docs(data, split)
    order = data.splits[split].epoch(epoch)[0]
    owner = [k for k, i in enumerate(order.tolist()) for _ in docs[i]]
    t = data.seq_len
    stream_rows = _stream_rows(data, split, epoch, rows)
    return [[owner[r * t + j] - owner[r * t] for j in range(t)] for r in stream_rows]


# ----------------------------------------------------------------------------------------
# Tokenizers
# ----------------------------------------------------------------------------------------


def test_byte_tokenizer() -> None:
    tok = load_tokenizer("")
    assert isinstance(tok, ByteTokenizer) and isinstance(tok, Tokenizer)
    assert tok.vocab_size == 256 and tok.eos_id is None and tok.bos_id is None
    assert tok.encode("hé") == [104, 195, 169]
    assert tok.decode([104, 195]) == "h\ufffd"  # a cut character is replaced


def test_bpe_round_trips(bpe: HFTokenizer) -> None:
    assert isinstance(bpe, Tokenizer)
    assert bpe.vocab_size == 400
    text = "def bisect(a, x):\n    return 'naïve ☃'  # unseen bytes too\n"
    ids = bpe.encode(text)
    assert len(ids) < len(text.encode())  # merges were learned
    assert bpe.decode(ids) == text
    assert bpe.eos_id == bpe.encode(ENDOFTEXT)[0] and len(bpe.encode(ENDOFTEXT)) == 1
    assert bpe.bos_id is None
    assert bpe.chat_template == CHATML_TEMPLATE
    assert load_tokenizer(str(Path(bpe.name).parent)).vocab_size == 400  # the folder works


def test_tokenizer_config_tokens(tmp_path: Path, bpe: HFTokenizer) -> None:
    """bos and eos as tokenizer_config.json writes them: strings or {"content": ...}; text
    documents then begin with the bos and end with the eos."""
    (tmp_path / "tokenizer.json").write_text(Path(bpe.name).read_text())
    settings = {"bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(settings))
    tok = load_tokenizer(str(tmp_path))
    assert (tok.bos_id, tok.eos_id) == (bpe.encode("<|im_start|>")[0], bpe.encode(IM_END)[0])
    assert tok.chat_template is None
    path = _jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in TEXTS])
    data = load_data(_config(path, tokenizer=str(tmp_path)))
    for doc in _split_docs(data, "train"):
        assert doc[0] == tok.bos_id and doc[-1] == tok.eos_id
        assert tok.decode(doc[1:-1]) in TEXTS
    settings["eos_token"] = "<|no such token|>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(settings))
    with pytest.raises(ConfigError, match=r"eos_token '<\|no such token\|>' is not in the"):
        load_tokenizer(str(tmp_path))


def test_tokenizer_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "code.py").write_text((STDLIB / "bisect.py").read_text())
    chat = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}]
    _jsonl(data / "chats.jsonl", [{"messages": chat}, {"text": "plain text record"}])
    out = tmp_path / "tok" / "tokenizer.json"
    argv = ["tokenizer", "train", "--data", str(data), "--out", str(out), "--vocab"]
    assert main([*argv, "300"]) == 0, capsys.readouterr()
    settings = json.loads((out.parent / "tokenizer_config.json").read_text())
    assert settings["eos_token"] == ENDOFTEXT and settings["chat_template"] == CHATML_TEMPLATE
    tok = load_tokenizer(str(out))
    assert tok.vocab_size == 300 and tok.decode(tok.encode("hi there")) == "hi there"
    assert "wrote" in capsys.readouterr().out
    assert main([*argv, "100"]) == 2
    assert "--vocab 100: a byte-level BPE holds the 256 bytes" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------
# Packing documents into rows
# ----------------------------------------------------------------------------------------


def _check_rows(data: TokenData, batch: Batch, split: str, epoch: int, rows: range) -> None:
    expected = _expected_rows(data, split, epoch, rows)
    assert batch.inputs.tolist() == [row[:-1] for row in expected]
    assert batch.targets.tolist() == [row[1:] for row in expected]  # text: all targets
    assert batch.documents.tolist() == _document_index(data, split, epoch, rows)


def test_jsonl_documents_are_packed(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in TEXTS])
    data = load_data(_config(path))
    train, val = _split_docs(data, "train"), _split_docs(data, "val")
    assert len(val) == 1 and len(train) == 9  # ~5%, at least one
    assert sorted(map(bytes, train + val)) == sorted(t.encode() for t in TEXTS)  # disjoint
    batch = data.batch("train", 1, 4)
    assert all(x.dtype == torch.int64 for x in (batch.inputs, batch.targets, batch.documents))
    _check_rows(data, batch, "train", 0, range(4, 8))
    # By hand: rows of distinct letters, the document index steps where the letter changes.
    for row, docs in zip(batch.inputs.tolist(), batch.documents.tolist(), strict=True):
        changes = [0] + [int(a != b) for a, b in itertools.pairwise(row)]
        assert docs == torch.tensor(changes).cumsum(0).tolist()
    assert data.vocab_size == 256
    assert "10 documents" in data.source


def test_bpe_documents_end_with_eos(tmp_path: Path, bpe: HFTokenizer) -> None:
    path = _jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in TEXTS])
    data = load_data(_config(path, tokenizer=bpe.name))
    assert data.vocab_size == 400
    for doc in _split_docs(data, "train"):
        assert doc[-1] == bpe.eos_id and bpe.decode(doc[:-1]) in TEXTS
    batch = data.batch("train", 0, 4)
    _check_rows(data, batch, "train", 0, range(4))
    for row, docs in zip(batch.inputs.tolist(), batch.documents.tolist(), strict=True):
        for i in range(1, len(row)):  # a new document begins right after an eos
            assert (docs[i] != docs[i - 1]) == (row[i - 1] == bpe.eos_id)


def test_parquet_reads_like_jsonl(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = _jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in TEXTS])
    pq.write_table(pa.table({"body": TEXTS, "id": list(range(10))}), tmp_path / "docs.parquet")
    a = load_data(_config(jsonl))
    b = load_data(_config(tmp_path / "docs.parquet", text_field="body"))
    for step in (0, 3):
        x, y = a.batch("train", step, 4), b.batch("train", step, 4)
        assert torch.equal(x.inputs, y.inputs) and torch.equal(x.documents, y.documents)


def test_directory_of_mixed_kinds(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    _jsonl(tmp_path / "a.jsonl", [{"text": t} for t in TEXTS[:4]])
    pq.write_table(pa.table({"text": TEXTS[4:8]}), tmp_path / "b.parquet")
    (tmp_path / "c.txt").write_text(TEXTS[8])
    (tmp_path / "d.json").write_text(json.dumps([{"text": TEXTS[9]}]))
    (tmp_path / ".hidden.txt").write_text("never read")
    data = load_data(_config(tmp_path))
    docs = _split_docs(data, "train") + _split_docs(data, "val")
    assert sorted(map(bytes, docs)) == sorted(t.encode() for t in TEXTS)


def test_single_document_is_cut_into_pieces(tmp_path: Path) -> None:
    path = tmp_path / "one.txt"
    path.write_text("".join(chr(ord("a") + i % 26) for i in range(2000)))
    data = load_data(_config(path))
    train, val = _split_docs(data, "train"), _split_docs(data, "val")
    assert len(train) == 19 and len(val) == 1 and len(val[0]) == 100  # every 20th piece
    assert bytes(val[0]) == path.read_bytes()[1900:]


# ----------------------------------------------------------------------------------------
# Chats: loss on the answers only
# ----------------------------------------------------------------------------------------

CHATS = [
    [
        {"role": "system", "content": f"be brief {i}"},
        {"role": "user", "content": f"question {i}?"},
        {"role": "assistant", "content": f"answer {i}."},
        {"role": "user", "content": "and?"},
        {"role": "assistant", "content": f"more {i}"},
    ]
    for i in range(6)
]


def _trained_text(data: TokenData, tok: Tokenizer) -> list[tuple[str, str]]:
    """Each stored training document: (its whole text, the text of its target tokens)."""
    part = data.splits["train"]
    out = []
    for i in range(part.n_docs):
        ids, mask = part.document(i).long(), part.document(i, part.trained)
        out.append((tok.decode(ids.tolist()), tok.decode(ids[mask].tolist())))
    return out


def test_chat_targets_are_the_answers(tmp_path: Path, bpe: HFTokenizer) -> None:
    path = _jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in CHATS])
    data = load_data(_config(path, tokenizer=bpe.name))
    for whole, trained in _trained_text(data, bpe):
        i = whole.split("be brief ")[1][0]
        assert whole.startswith("<|im_start|>system\n") and whole.endswith(ENDOFTEXT)
        assert trained == f"answer {i}.{IM_END}\nmore {i}{IM_END}\n"
    # In the packed rows: a target takes loss exactly where its token is a trained one.
    rows = data.rows_per_epoch("train")  # the whole epoch, as one batch
    batch = data.batch("train", 0, rows)
    expected = _expected_rows(data, "train", 0, range(rows))
    part = data.splits["train"]
    order = part.epoch(0)[0]
    mask = [m for i in order.tolist() for m in part.document(i, part.trained).tolist()]
    stream_rows = _stream_rows(data, "train", 0, range(rows))
    for r, row, targets in zip(stream_rows, expected, batch.targets.tolist(), strict=True):
        keep = mask[r * 8 + 1 : r * 8 + 9]
        assert targets == [t if k else IGNORE for t, k in zip(row[1:], keep, strict=True)]
    assert (batch.targets == IGNORE).any() and (batch.targets != IGNORE).any()


def test_byte_chat_uses_the_plain_template(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in CHATS])
    data = load_data(_config(path))
    for whole, trained in _trained_text(data, ByteTokenizer()):
        i = whole.split("be brief ")[1][0]
        assert whole.startswith(f"system: be brief {i}\n\nuser: question {i}?\n\nassistant: ")
        assert trained == f"answer {i}.\n\nmore {i}\n\n"


def test_chat_template_must_render_prefixes(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in CHATS])
    template = tmp_path / "odd.jinja"  # the generation prompt is not how turns begin
    template.write_text(
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}bot> {% endif %}"
    )
    with pytest.raises(ConfigError, match=r"chats.jsonl:1: .*assistant turn 2.* prefix"):
        load_data(_config(path, chat_template=str(template)))


# ----------------------------------------------------------------------------------------
# Batches are a pure function of (seed, split, step)
# ----------------------------------------------------------------------------------------


def _fields(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return batch.inputs, batch.targets, batch.documents


def _same(a: Batch, b: Batch) -> bool:
    return all(torch.equal(x, y) for x, y in zip(_fields(a), _fields(b), strict=True))


def test_batches_are_pure_and_parts_make_the_whole(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in TEXTS])
    a, b = load_data(_config(path)), load_data(_config(path))
    for split, step in [("train", 0), ("train", 7), ("train", 1000), ("val", 3)]:
        whole = a.batch(split, step, 4)
        assert _same(whole, b.batch(split, step, 4))
        parts = [b.batch(split, step, 4, part, 4) for part in range(4)]
        assert _same(whole, Batch(*(torch.cat(x) for x in zip(*map(_fields, parts), strict=True))))
    other = load_data(_config(path, seed=1))
    assert not torch.equal(other.batch("train", 0, 4).inputs, a.batch("train", 0, 4).inputs)


def test_epochs_wrap_and_reshuffle(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in TEXTS])
    data = load_data(_config(path))
    rows = data.rows_per_epoch("train")
    assert rows == (sum(len(d) for d in _split_docs(data, "train")) - 1) // 8
    first, second = data.splits["train"].epoch(0)[0], data.splits["train"].epoch(1)[0]
    assert not torch.equal(first, second)  # 9 documents: 1 in 9! to be equal
    # A global batch straddling the end of epoch 0: its last rows are epoch 1's first.
    step = rows // 3  # batch_size 3: rows 3 * step ... 3 * step + 2
    batch = data.batch("train", step, 3)
    expected = _expected_rows(data, "train", 0, range(3 * step, rows))
    expected += _expected_rows(data, "train", 1, range(3 * step + 3 - rows))
    assert batch.inputs.tolist() == [row[:-1] for row in expected]
    assert batch.targets.tolist() == [row[1:] for row in expected]


def test_fingerprint_warns_when_the_data_changed(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in TEXTS])
    run = tmp_path / "run"
    assert record_fingerprint(run, load_data(_config(path)), resume=False) is None
    assert record_fingerprint(run, load_data(_config(path)), resume=True) is None
    _jsonl(path, [{"text": t + "!"} for t in TEXTS])
    note = record_fingerprint(run, load_data(_config(path)), resume=True)
    assert note is not None and "changed" in note


# ----------------------------------------------------------------------------------------
# Refusals
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ('{"text": "ok"}\nnot json\n', r"docs.jsonl:2: not a JSON object"),
        ('{"text": "ok"}\n\n{"body": "x"}\n', r"docs.jsonl:3: .*neither a 'text' .* 'messages'"),
        ('{"text": 3}\n', r"docs.jsonl:1: the 'text' field must be a string"),
        ("[1, 2]\n", r"docs.jsonl: item 0: a record must be a JSON object"),
        ('{"messages": [{"role": "user"}]}\n', r"docs.jsonl:1: message 0 of 'messages'"),
    ],
)
def test_bad_records_are_refused(tmp_path: Path, lines: str, message: str) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text(lines)
    with pytest.raises(ConfigError, match=message):
        load_data(_config(path))


def test_missing_parquet_column_is_refused(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": TEXTS}), tmp_path / "docs.parquet")
    with pytest.raises(ConfigError, match=r"docs.parquet: no column 'text' .* columns: body"):
        load_data(_config(tmp_path / "docs.parquet"))


def test_too_little_data_is_refused(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "docs.jsonl", [{"text": "abc"}, {"text": "defgh"}])
    with pytest.raises(ConfigError, match=r"--data .*docs.jsonl: .*--seq-len 8 .*give more text"):
        load_data(_config(path))


def test_chat_without_a_template_is_refused(tmp_path: Path, bpe: HFTokenizer) -> None:
    plain = tmp_path / "tok"
    plain.mkdir()
    (plain / "tokenizer.json").write_text(Path(bpe.name).read_text())  # no config beside
    path = _jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in CHATS])
    with pytest.raises(ConfigError, match=r"chats.jsonl:1: a chat, .* --chat-template"):
        load_data(_config(path, tokenizer=str(plain)))


def test_model_vocabulary_follows_the_tokenizer(tmp_path: Path, bpe: HFTokenizer) -> None:
    cfg = resolve(TrainConfig(tokenizer=bpe.name, device="cpu"), 1)
    assert cfg.vocab_size == 400
    assert resolve(TrainConfig(device="cpu"), 1).vocab_size == 256
    assert resolve(TrainConfig(tokenizer=bpe.name, vocab_size=512, device="cpu"), 1).vocab_size
    with pytest.raises(ConfigError, match=r"--vocab-size 300 is smaller than the 400 ids"):
        resolve(TrainConfig(tokenizer=bpe.name, vocab_size=300, device="cpu"), 1)
    llama = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "vocab_size": 256,
        "max_position_embeddings": 128,
    }
    config = tmp_path / "config.json"
    config.write_text(json.dumps(llama))
    with pytest.raises(ConfigError, match=r"config.json: vocab_size 256 .* 400 ids .*tokenizer"):
        resolve(TrainConfig(tokenizer=bpe.name, model_config=str(config), device="cpu"), 1)
    llama["vocab_size"] = 512
    config.write_text(json.dumps(llama))
    with pytest.raises(ConfigError, match=r"--vocab-size 448 with --model-config .* drop"):
        resolve(TrainConfig(tokenizer=bpe.name, model_config=str(config), vocab_size=448), 1)
    resolved = resolve(TrainConfig(tokenizer=bpe.name, model_config=str(config), device="cpu"), 1)
    assert resolve(resolved, 1).vocab_size == 400  # a resumed run's recorded value passes


# ----------------------------------------------------------------------------------------
# A run with a BPE: the model's vocabulary, the checkpoint, sampling
# ----------------------------------------------------------------------------------------


def test_train_and_sample_with_a_bpe(tmp_path: Path, bpe: HFTokenizer) -> None:
    from plait.train.checkpointing import check_settings, latest_checkpoint
    from plait.train.loop import model_settings
    from plait.train.sample import sample_command

    from train_helpers import TINY, run_train

    paragraphs = [p for name in BPE_FILES for p in (STDLIB / name).read_text().split("\n\n")]
    data = _jsonl(tmp_path / "docs.jsonl", [{"text": p} for p in paragraphs if p.strip()])
    cfg = TINY.replace(data=str(data), tokenizer=bpe.name, steps=2)
    result = run_train(cfg, 1, tmp_path / "run")
    assert len(result.losses) == 2 and all(loss < 7 for loss in result.losses)  # ln 400 = 6
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["vocab_size"] == 400 and saved["tokenizer"] == bpe.name
    out = sample_command(str(tmp_path / "run"), None, "def ", 10, 0.8, 0, 0)
    assert out.startswith("def ")
    latest = latest_checkpoint(tmp_path / "run")
    assert latest is not None
    with pytest.raises(ConfigError, match="vocab_size 400 .*--vocab-size 256"):
        check_settings(latest, model_settings(resolve(TINY, 1)))  # the byte tokenizer


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tokenizer", "/no/such/tokenizer.json"], "--tokenizer /no/such/tokenizer.json: no"),
        (["--chat-template", "/no/such.jinja"], "--chat-template /no/such.jinja: no such file"),
    ],
)
def test_missing_files_are_refused_before_launch(
    argv: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from train_helpers import forbid_launch

    forbid_launch(monkeypatch, "a worker was started for a missing file")
    assert main(["train", "--device", "cpu", *argv]) == 2
    assert message in capsys.readouterr().err


# ----------------------------------------------------------------------------------------
# The token cache: tokenized once (per machine), the same batches
# ----------------------------------------------------------------------------------------


def _count_tokenizing(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list whose length counts the calls of data._tokenize from now on."""
    calls: list[int] = []
    real = data_module._tokenize

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(data_module, "_tokenize", counted)
    return calls


def _all_batches(data: TokenData) -> list[torch.Tensor]:
    steps = [("train", s) for s in (0, 1, 5, 40)] + [("val", s) for s in (0, 3)]
    return [x for split, step in steps for x in _fields(data.batch(split, step, 4))]


def _same_data(a: TokenData, b: TokenData) -> bool:
    return a.fingerprint == b.fingerprint and all(
        torch.equal(x, y) for x, y in zip(_all_batches(a), _all_batches(b), strict=True)
    )


def _mixed_corpus(tmp_path: Path) -> Path:
    """Texts and chats: tokens, masks and the split's hashes all go through the cache."""
    records = [{"text": t * 3} for t in TEXTS] + [{"messages": m} for m in CHATS]
    return _jsonl(tmp_path / "mixed.jsonl", records)


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_cache_gives_the_same_batches(
    tmp_path: Path, bpe: HFTokenizer, tokenizer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _config(_mixed_corpus(tmp_path), tokenizer=bpe.name if tokenizer == "bpe" else "")
    cache = tmp_path / "cache"
    calls = _count_tokenizing(monkeypatch)
    plain = load_data(cfg, use_cache=False)
    assert len(calls) == 1 and not cache.exists()
    cold = load_data(cfg, cache)
    assert len(calls) == 2 and len(list(cache.glob("*.tokens"))) == 1
    warm = load_data(cfg, cache)
    assert len(calls) == 2  # a hit tokenizes nothing
    assert _same_data(plain, cold) and _same_data(plain, warm)
    assert not list(cache.glob(".*"))  # no temporary file left behind
    # The environment variable names the folder; "off" turns the cache off.
    monkeypatch.setenv("PLAIT_DATA_CACHE", str(cache))
    assert _same_data(plain, load_data(cfg)) and len(calls) == 2
    monkeypatch.setenv("PLAIT_DATA_CACHE", "off")
    assert data_module.cache_dir() is None
    load_data(cfg)
    assert len(calls) == 3


def test_cached_documents_are_read_in_place(tmp_path: Path) -> None:
    """A run reading the cache holds no copy of the corpus: both splits read their
    documents from the cache's one memory-mapped array (shared by every worker of a
    machine); the batches and the fingerprint are those of a run without the cache, whose
    documents are concatenated. Plain text has no loss mask: none is allocated."""
    records = [{"text": t * 3} for t in TEXTS] * 3
    cfg, cache = _config(_jsonl(tmp_path / "texts.jsonl", records)), tmp_path / "cache"
    plain = load_data(cfg, use_cache=False)
    load_data(cfg, cache)  # tokenizes and writes the cache
    warm = load_data(cfg, cache)
    train, val = warm.splits["train"], warm.splits["val"]
    assert train.tokens is not val.tokens
    assert train.tokens.data_ptr() == val.tokens.data_ptr()  # the cache's array, twice
    assert len(train.tokens) == train.n_tokens + val.n_tokens
    for part in (train, val):
        assert part.trained is None and part.all_trained
        assert all(
            part.document(i).untyped_storage().data_ptr() == part.tokens.data_ptr()
            for i in range(part.n_docs)
        )
    assert plain.splits["train"].tokens.data_ptr() != plain.splits["val"].tokens.data_ptr()
    assert _same_data(plain, warm)


def test_single_document_through_the_cache(tmp_path: Path) -> None:
    path = tmp_path / "one.txt"
    path.write_text("".join(TEXTS) * 20)
    cfg, cache = _config(path), tmp_path / "cache"
    plain = load_data(cfg, use_cache=False)
    assert _same_data(plain, load_data(cfg, cache)) and _same_data(plain, load_data(cfg, cache))


def test_changes_invalidate_the_cache(
    tmp_path: Path, bpe: HFTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    path = _jsonl(corpus / "a.jsonl", [{"text": t * 3} for t in TEXTS])
    tok = tmp_path / "tok"
    tok.mkdir()
    shutil.copy(bpe.name, tok / "tokenizer.json")
    cfg, cache = _config(corpus, tokenizer=str(tok / "tokenizer.json")), tmp_path / "cache"
    calls = _count_tokenizing(monkeypatch)
    first = load_data(cfg, cache)
    load_data(cfg, cache)
    assert len(calls) == 1

    def changed(expect_new: bool = True) -> TokenData:
        before = len(calls)
        data = load_data(cfg, cache)
        assert len(calls) == before + expect_new
        assert _same_data(data, load_data(dataclasses.replace(cfg), use_cache=False))
        return data

    # The same size, rewritten at once: a file's bytes, not only its time, are in the key.
    path.write_text(path.read_text().replace("aaaaa", "zzzzz"))
    assert not _same_data(first, changed())
    _jsonl(corpus / "b.jsonl", [{"text": "another document"}])  # a file more
    changed()
    (tok / "tokenizer_config.json").write_text(json.dumps({"eos_token": ENDOFTEXT}))
    with_eos = changed()  # the tokenizer's settings changed: documents end with its eos
    assert with_eos.splits["train"].document(0)[-1] == bpe.encode(ENDOFTEXT)[0]
    changed(expect_new=False)  # back to a hit
    cfg = dataclasses.replace(cfg, text_field="body")  # other fields: other records
    with pytest.raises(ConfigError, match="neither a 'body' field"):
        load_data(cfg, cache)


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage", "empty"])
def test_a_damaged_cache_file_is_rebuilt(
    tmp_path: Path, damage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg, cache = _config(_mixed_corpus(tmp_path)), tmp_path / "cache"
    plain = load_data(cfg, cache)
    (file,) = cache.glob("*.tokens")
    content = bytearray(file.read_bytes())
    if damage == "flip":
        content[-10] ^= 0xFF  # a byte of the last array (the split's hashes)
    elif damage == "truncate":
        content = content[: len(content) // 2]
    elif damage == "garbage":
        content = bytearray(b"not a cache file at all" * 10)
    else:
        content = bytearray()
    file.write_bytes(bytes(content))
    calls = _count_tokenizing(monkeypatch)
    with pytest.warns(UserWarning, match=r"token cache .*tokenizing again"):
        rebuilt = load_data(cfg, cache)
    assert len(calls) == 1 and _same_data(plain, rebuilt)
    assert _same_data(plain, load_data(cfg, cache)) and len(calls) == 1  # rewritten whole


def test_an_unwritable_cache_only_warns(tmp_path: Path) -> None:
    cfg = _config(_mixed_corpus(tmp_path))
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache folder would be")
    with pytest.warns(UserWarning, match="cannot write it"):
        data = load_data(cfg, blocker / "cache")
    assert _same_data(data, load_data(cfg, use_cache=False))


def _load_on_ranks(cfg: TrainConfig, cache: str, local_ranks: list[int] | None = None) -> Any:
    """On each rank: load_data under the default group, counting tokenizations here;
    ``local_ranks``: each rank's LOCAL_RANK, as torchrun sets it."""
    calls = 0
    if local_ranks is not None:
        os.environ["LOCAL_RANK"] = str(local_ranks[dist.get_rank()])
    real = data_module._tokenize

    def counted(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        return real(*args)

    data_module._tokenize = counted  # type: ignore[assignment]
    try:
        data = load_data(cfg, Path(cache))
    except ConfigError as err:
        return calls, str(err)
    finally:
        data_module._tokenize = real  # type: ignore[assignment]
        os.environ.pop("LOCAL_RANK", None)
    return calls, [x.tolist() for x in _all_batches(data)], data.fingerprint


def test_ranks_of_a_machine_tokenize_once(tmp_path: Path) -> None:
    cfg, cache = _config(_mixed_corpus(tmp_path)), tmp_path / "cache"
    plain = load_data(cfg, use_cache=False)
    expected = ([x.tolist() for x in _all_batches(plain)], plain.fingerprint)
    cold = run_on_ranks(2, _load_on_ranks, cfg, str(cache))
    assert [c[0] for c in cold] == [1, 0]  # rank 0 tokenized, rank 1 read its file
    assert all(tuple(c[1:]) == expected for c in cold)
    warm = run_on_ranks(2, _load_on_ranks, cfg, str(cache))
    assert [c[0] for c in warm] == [0, 0] and all(tuple(c[1:]) == expected for c in warm)


@pytest.mark.parametrize(("local_ranks", "writers"), [([1, 0], [0, 1]), ([0, 0], None)])
def test_local_rank_zero_tokenizes_for_its_machine(
    tmp_path: Path, local_ranks: list[int], writers: list[int] | None
) -> None:
    """Under torchrun LOCAL_RANK 0 writes and the other waits; two "machines" (both
    LOCAL_RANK 0) each look for themselves: whichever comes second may already find the
    first's file in a shared folder, so between them they tokenize once or twice."""
    cfg, cache = _config(_mixed_corpus(tmp_path)), tmp_path / "cache"
    results = run_on_ranks(2, _load_on_ranks, cfg, str(cache), local_ranks)
    calls = [r[0] for r in results]
    if writers is not None:
        assert calls == writers
    else:
        assert set(calls) <= {0, 1} and sum(calls) >= 1
    assert results[0][1:] == results[1][1:]
    assert len(list(cache.glob("*.tokens"))) == 1


def test_a_failed_tokenizing_fails_every_rank(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"title": "no text"}\n')
    results = run_on_ranks(2, _load_on_ranks, _config(path), str(tmp_path / "cache"))
    assert "bad.jsonl:2" in results[0][1]  # the writer's own error
    assert "failed on another rank" in results[1][1]
    assert not (tmp_path / "cache").exists()
