"""``torch.distributed.pipelining`` as the redirected tests see it: plait's objects.

The client rewrites ``from torch.distributed.pipelining[.schedules|.stage|.microbatch]
import ...`` in the test files' copies to import from this package instead; every name
is looked up in plait when first imported (:mod:`._resolve`).
"""

from typing import Any

from ._resolve import resolve


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return resolve("torch.distributed.pipelining", name)[0]
