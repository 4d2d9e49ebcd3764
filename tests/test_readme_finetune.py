"""The README's fine-tune walkthrough runs as written (with fewer steps): a chat dataset, a
trained tokenizer, a pretrained tiny Llama exported as a Hugging Face checkpoint, the
fine-tune from it and its export, which transformers loads with plait's logits and
tokenization."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- fine-tune walkthrough: tests/test_readme_finetune.py runs these commands -->"


def _walkthrough() -> list[list[str]]:
    """The commands of the README's walkthrough block, continuation lines joined."""
    text = (ROOT / "README.md").read_text()
    assert MARKER in text, "the README lost its fine-tune walkthrough"
    block = text.split(MARKER, 1)[1]
    body = re.search(r"```bash\n(.*?)```", block, re.S)
    assert body is not None
    joined = body.group(1).replace("\\\n", " ")
    lines = [line.strip() for line in joined.splitlines()]
    return [shlex.split(line) for line in lines if line and not line.startswith("#")]


def _command(words: list[str]) -> list[str]:
    """A README line as this test runs it: ``./dev`` through this interpreter, and 2
    steps instead of the README's (the commands and flags are what is checked)."""
    assert words[0] == "./dev", words
    verb, rest = words[1], words[2:]
    if verb == "python":
        return [sys.executable, str(ROOT / rest[0]), *rest[1:]]
    args = rest if verb == "plait" else [verb, *rest]
    if "--steps" in args:
        args[args.index("--steps") + 1] = "2"
    return [sys.executable, "-m", "plait", *args]


def test_the_readme_walkthrough_runs(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    commands = _walkthrough()
    assert [c[1] for c in commands] == ["python", "plait", "train", "plait", "train", "plait"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    for words in commands:
        done = subprocess.run(
            _command(words), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, f"{shlex.join(words)}\n{done.stdout}\n{done.stderr}"
    out = tmp_path / "runs" / "chat-hf"
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}

    from plait.train.hf import load_hf_checkpoint
    from plait.train.llama import Llama, LlamaConfig
    from plait.train.tokenizer import load_tokenizer

    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    text = "What does textwrap.dedent do?"
    ids = load_tokenizer(str(out / "tokenizer.json")).encode(text)
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == ids
    ours = Llama(LlamaConfig.from_file(out / "config.json"), seq_len=256).eval()
    load_hf_checkpoint([ours], out)
    idx = torch.tensor([ids])
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), model(idx).logits, rtol=0, atol=1e-5)
