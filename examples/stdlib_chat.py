"""Write a small chat dataset (JSON lines) from the Python standard library's docstrings.

Each line is one conversation in the ``messages`` format ``plait train`` fine-tunes on::

    {"messages": [{"role": "user", "content": "What does textwrap.dedent do?"},
                  {"role": "assistant", "content": "Remove any common leading whitespace..."}]}

The answers are the first paragraph of each public function's docstring, so the data
needs no download and is the same on every machine with the same Python. Usage::

    python examples/stdlib_chat.py --out runs/stdlib-chat.jsonl
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
from pathlib import Path

MODULES = (
    "base64",
    "bisect",
    "calendar",
    "collections",
    "colorsys",
    "copy",
    "difflib",
    "fnmatch",
    "functools",
    "glob",
    "heapq",
    "html",
    "json",
    "keyword",
    "os.path",
    "posixpath",
    "random",
    "shlex",
    "shutil",
    "statistics",
    "string",
    "textwrap",
    "urllib.parse",
    "uuid",
    "zipfile",
)


def conversations() -> list[dict[str, list[dict[str, str]]]]:
    """One conversation per public function with a docstring, in a fixed order."""
    chats = []
    for name in MODULES:
        module = importlib.import_module(name)
        for attr in sorted(vars(module)):
            fn = getattr(module, attr)
            if attr.startswith("_") or not inspect.isfunction(fn):
                continue
            doc = inspect.getdoc(fn)
            if not doc:
                continue
            answer = doc.split("\n\n")[0].replace("\n", " ").strip()
            if len(answer) < 20:
                continue
            chats.append(
                {
                    "messages": [
                        {"role": "user", "content": f"What does {name}.{attr} do?"},
                        {"role": "assistant", "content": answer},
                    ]
                }
            )
    return chats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="the JSON-lines file to write")
    out = Path(parser.parse_args().out)
    out.parent.mkdir(parents=True, exist_ok=True)
    chats = conversations()
    with open(out, "w") as f:
        f.writelines(json.dumps(chat) + "\n" for chat in chats)
    print(f"{out}: {len(chats)} conversations")


if __name__ == "__main__":
    main()
