"""The rules of what the parallelisms inside a model split: tensor parallelism its heads,
widths, vocabulary and (with sequence parallelism) sequences; context parallelism every
sequence into balanced chunks (and with Ulysses the heads); expert parallelism the routed
experts, over ranks it borrows from ``dp_shard x cp``.

Each rule returns :class:`~plait.layout.Reason` s naming the fix in ``plait train``'s flag
words; model flags (``--n-head``, ``--experts`` ...) are suggested only for a model shaped
by them (:attr:`ModelShape.from_flags`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from plait.layout.dims import CP, CP_METHODS, EP, TP
from plait.layout.reasons import Reason
from plait.layout.shape import ModelShape
from plait.layout.world import divisors

__all__ = ["Split", "check_cp", "check_ep", "check_tp", "moe_tp_width", "tp_splits"]


@dataclass(frozen=True)
class Split:
    """A size that tensor parallelism splits: ``what`` it is in words (``the 4 attention
    heads``), its ``size``, and the ``option`` that changes it ("" for none)."""

    what: str
    size: int
    option: str


def moe_tp_width(expert_hidden: int, shared_experts: int, d_model: int) -> int:
    """The feed-forward width tensor parallelism splits in a mixture-of-experts block
    (``ModelShape.d_mlp`` of a MoE model): its shared experts' (the routed experts are
    split by ``ep``, not ``tp``), or without them ``d_model``, already a split."""
    return expert_hidden * shared_experts or d_model


def tp_splits(model: ModelShape, sequence_parallel: bool) -> list[Split]:
    """What tensor parallelism splits ``tp`` ways (its plan: ``plait.train.parallelize``):
    heads, widths and vocabulary, and with sequence parallelism the sequence."""
    gpt = model.from_flags
    mlp = f" ({model.d_mlp // model.d_model} x --d-model)" if gpt else ""
    splits = [
        Split(f"the {model.heads} attention heads", model.heads, "--n-head" if gpt else ""),
        Split(f"the {model.kv_heads} KV heads", model.kv_heads, ""),
        Split(f"the model width {model.d_model}", model.d_model, "--d-model" if gpt else ""),
        Split(f"the MLP width {model.d_mlp}{mlp}", model.d_mlp, "--d-model" if gpt else ""),
    ]
    vocabulary = f"the vocabulary of {model.vocab} {model.tokens} (embedding and head)"
    splits.append(Split(vocabulary, model.vocab, ""))
    if sequence_parallel:
        what = f"each sequence of {model.seq_len} tokens (sequence parallelism)"
        splits.append(Split(what, model.seq_len, "--seq-len"))
    return splits


def check_tp(model: ModelShape, tp: int, sequence_parallel: bool) -> list[Reason]:
    """Everything :func:`tp_splits` names must divide by ``tp``."""
    if tp == 1:
        return []
    splits = tp_splits(model, sequence_parallel)
    # The largest tp up to the given one that splits everything: the fix to suggest.
    fits = max(t for t in range(1, tp + 1) if all(s.size % t == 0 for s in splits))
    reasons = []
    for split in splits:
        if split.size % tp == 0:
            continue
        fixes = [f"use --tp {fits}" if fits > 1 else "drop --tp"]
        if split.option:
            fixes.append(f"set {split.option} to a multiple of {tp}")
        if split.option == "--seq-len":
            fixes.append("turn it off with --no-sequence-parallel")
        problem = f"--tp {tp} splits {split.what} {tp} ways, but {split.size} does not divide"
        reasons.append(Reason(TP, f"{problem} by {tp}: {', or '.join(fixes)}"))
    return reasons


def check_cp(model: ModelShape, cp: int, method: str, tp: int = 1) -> list[Reason]:
    """``cp`` splits every sequence into ``2 x cp`` equal chunks (each rank a head and a
    tail chunk, so causal attention costs each the same); ``alltoall`` also splits the
    heads (each tp rank's) ``cp`` ways."""
    if method not in CP_METHODS:
        return [
            Reason(
                "cp_method", f"--cp-method {method}: unknown; choose one of {', '.join(CP_METHODS)}"
            )
        ]
    if cp == 1:
        return []
    reasons = []
    if model.seq_len % (2 * cp):
        fits = [c for c in divisors(model.seq_len // 2) if c < cp] or [1]
        seq = "--seq-len" if model.from_flags else "the sequence length"
        message = (
            f"--cp {cp} splits each sequence into {2 * cp} chunks (a head and a tail chunk per "
            f"rank, for balanced causal attention), but {seq} {model.seq_len} does not divide "
            f"by {2 * cp}: use a {seq} that is a multiple of {2 * cp}, or --cp {fits[-1]}"
        )
        reasons.append(Reason(CP, message))
    if method == "alltoall":
        for what, heads in (("attention heads", model.heads), ("KV heads", model.kv_heads)):
            if heads % (cp * tp):
                per = f"the {heads} {what}" + (f" over --tp {tp}" if tp > 1 else "")
                message = (
                    f"--cp-method alltoall splits {per} {cp} more ways (--cp {cp}), but "
                    f"{heads} does not divide by {cp * tp}: use --cp-method ring or "
                    f"allgather, or a --cp that divides {heads // math.gcd(heads, tp)}"
                )
                reasons.append(Reason("cp_method", message))
                break
    return reasons


def check_ep(model: ModelShape, ep: int, dp_shard: int) -> list[Reason]:
    """``ep`` must split the model's routed experts into equal whole sets, and take its
    ranks from ``dp_shard`` (times ``cp``: the ranks that hold different tokens): it
    divides both."""
    if ep == 1:
        return []
    if model.experts == 0:
        fix = f"add --experts {2 * ep} (or another multiple of {ep})" if model.from_flags else ""
        message = f"--ep {ep} splits the routed experts, but the model has none"
        return [Reason(EP, f"{message}: {fix or 'drop --ep'}")]
    reasons = []
    if model.experts % ep:
        fits = [d for d in divisors(model.experts) if d > 1 and dp_shard % d == 0]
        fix = f"use --ep {fits[-1]}" if fits else "drop --ep"
        if model.from_flags:
            fix += f", or --experts a multiple of {ep}"
        message = (
            f"--ep {ep} splits the {model.experts} routed experts {ep} ways, but {ep} does not "
            f"divide {model.experts} (each rank holds the same number of whole experts)"
        )
        reasons.append(Reason(EP, f"{message}: {fix}"))
    if dp_shard % ep:
        message = (
            f"--ep {ep} takes its ranks from --dp-shard (the ranks holding different tokens), "
            f"but --dp-shard {dp_shard} is not a multiple of {ep}: use --dp-shard "
            f"{ep * -(-dp_shard // ep)} (more --nproc), or an --ep that divides {dp_shard}"
        )
        reasons.append(Reason(EP, message))
    return reasons
