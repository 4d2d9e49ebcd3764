"""``torch.distributed.pipelining.microbatch`` as the redirected tests see it: plait's objects."""

from typing import Any

from ._resolve import resolve


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return resolve("torch.distributed.pipelining.microbatch", name)[0]
