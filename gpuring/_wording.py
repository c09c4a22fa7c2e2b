"""How gpuring says what went wrong: ranks in words ("ranks 0-2, 5"), and what differs between
the calls of ranks that should have called alike, in the words of the call ("rank 2 passed
float64, ranks 0-1 float32"): only what the user set (the call's arguments first; the call's
tuning only where those agree; the settings, by their variable, only where both agree), never
the fields gpuring works out for itself."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["ranks_text", "call_words", "differences_text", "call_fields", "compare_calls"]


def ranks_text(ranks: Iterable[int]) -> str:
    """`rank 3`, `ranks 0-2, 5`: ranks in words, runs joined."""
    ordered = sorted(set(ranks))
    runs: list[list[int]] = []
    for r in ordered:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    text = ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)
    return f"rank {text}" if len(ordered) == 1 else f"ranks {text}"


#: the collectives that take an op, and those that take a root
REDUCING = frozenset({"all_reduce", "reduce_scatter", "reduce"})
ROOTED = frozenset({"broadcast", "reduce", "gather", "scatter"})


def call_words(verb: str, shape: Any, dtype: Any, op: Any = None, root: Any = None) -> str:
    """A call in words: `all_reduce(float32[4, 2], op=sum)`, `broadcast(int8[3], root=1)`,
    `barrier()` (`shape`: a tuple, or its text; the op and root only where the verb takes
    them)."""
    if dtype is None:
        return f"{verb}()"
    if not isinstance(shape, str):
        shape = ", ".join(map(str, shape))
    parts = [f"{dtype}[{shape.strip('()').rstrip(',')}]"]
    if verb in REDUCING and op is not None:
        parts.append(f"op={getattr(op, 'value', op)}")
    if verb in ROOTED and root is not None:
        parts.append(f"root={root}")
    return f"{verb}({', '.join(parts)})"


#: the fields the call itself gives, its tuning (a call's argument or a setting), and the
#: settings (named by their variable): a mismatch names the first of these tiers that differs
_CALL = ("collective", "device", "shape", "dtype", "op", "root")
_TUNING = ("algorithm", "chunk_bytes", "channels", "registered", "form")
_SETTINGS = {"deterministic": "GPURING_DETERMINISTIC", "transport": "GPURING_TRANSPORT",
             "tuning": "GPURING_TUNING", "one_shot_bytes": "GPURING_ONE_SHOT_BYTES",
             "fused_bytes": "GPURING_FUSED_BYTES", "buffer_bytes": "GPURING_BUFFER_BYTES",
             "attach_bytes": "GPURING_ATTACH_BYTES",
             "verify": "GPURING_VERIFY"}
#: how the first rank's value of a field is said ("{who}" the ranks, "{v}" the value), and
#: then the others' ("{v}")
_SAID = {"collective": ("{who} called {v}", "{v}"),
         "device": ("{who} passed {v} arrays", "{v}"),
         "shape": ("{who} passed shape {v}", "{v}"),
         "dtype": ("{who} passed {v}", "{v}"),
         "op": ("{who} passed op={v}", "op={v}"),
         "root": ("{who} passed root={v}", "root={v}"),
         "algorithm": ("{who} ran algorithm={v}", "algorithm={v}"),
         "chunk_bytes": ("{who} ran chunk_bytes={v}", "chunk_bytes={v}"),
         "channels": ("{who} ran channels={v}", "channels={v}"),
         "registered": ("{who} passed {v}", "{v}"),
         "form": ("{who} ran {v}", "{v}"),
         "device_settings": ("{who} has the device settings {v}", "{v}")}


def _value(field: str, value: Any) -> str:
    if field == "registered":
        return "plain arrays" if value is None else f"arrays in registered memory {value}"
    if field == "form":
        return value or "in rounds"
    if field == "tuning":
        return "unset" if value is None else f"a table ({value})"
    return str(value)


def _said(field: str, values: Mapping[int, Any]) -> str:
    groups: dict[str, list[int]] = {}
    for rank, value in values.items():
        groups.setdefault(_value(field, value), []).append(rank)
    # the fewest first, and of as many, the one of the highest ranks: rank 0's group, the
    # reference most read, comes last
    ordered = sorted(groups.items(), key=lambda g: (len(g[1]), -min(g[1])))
    if field in _SETTINGS:
        first, then = f"{{who}} has {_SETTINGS[field]}={{v}}", "{v}"
    else:
        first, then = _SAID.get(field, (f"{{who}} {field}={{v}}", "{v}"))
    (value, ranks), *others = ordered
    parts = [first.format(who=ranks_text(ranks), v=value)]
    parts += [f"{ranks_text(rs)} {then.format(v=v)}" for v, rs in others]
    return ", ".join(parts)


def differences_text(differences: Mapping[str, Mapping[int, Any]],
                     calls: Mapping[int, str] | None = None) -> str:
    """What differs, in words (`differences`: field -> {rank: value}, `Signature`'s fields or
    `call_fields`'): the fields of the first tier (the call, its tuning, the settings) in
    which the ranks differ; where the collective differs, each rank's call (`calls`: rank ->
    `call_words`, where given) instead."""
    if "collective" in differences and calls:
        return _said("collective", calls)
    tiers = (_CALL, _TUNING, (*_SETTINGS, "device_settings"))
    for tier in tiers:
        named = [f for f in tier if f in differences]
        if named:
            return "; ".join(_said(f, differences[f]) for f in named)
    return "; ".join(_said(f, values) for f, values in differences.items())


_TEXT = re.compile(r"^(\w+)\((.*?)\)(?: (.*))?$")
_ARGUMENT = re.compile(r"(\w+)=(\([^)]*\)|[^,]+)")


def call_fields(text: str) -> dict[str, str]:
    """A prepared call's text (`PreparedCall.text`: `all_reduce(shape=(4,), dtype=float32,
    ..., algorithm=auto) fused`) as fields: `collective`, each argument, and `form` (what
    follows the arguments: fused, in registered memory; "" for none)."""
    match = _TEXT.match(text)
    if match is None:
        return {"collective": text}
    name, arguments, form = match.groups()
    fields = {"collective": name, "form": form or ""}
    fields.update((k, v.strip()) for k, v in _ARGUMENT.findall(arguments))
    return fields


def compare_calls(calls: Mapping[int, str]) -> tuple[str, dict[str, dict[int, object]]]:
    """What differs between the prepared calls' texts of some ranks (rank -> text), in words,
    and as differences (field -> {rank: value})."""
    fields = {rank: call_fields(text) for rank, text in calls.items()}
    names: list[str] = []
    for f in fields.values():
        names += [n for n in f if n not in names]
    differences: dict[str, dict[int, object]] = {
        n: {r: f.get(n, "") for r, f in fields.items()} for n in names}
    differences = {n: v for n, v in differences.items() if len(set(v.values())) > 1}
    words = {r: call_words(f["collective"], f.get("shape", "()"), f.get("dtype"), f.get("op"),
                           f.get("root")) for r, f in fields.items()}
    return differences_text(differences, words), differences
