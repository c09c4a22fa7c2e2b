"""`gpuring doctor DIR`: what the flight recorder's dumps of every rank say, on one screen.

Reads the dumps (`_recorder`, one file per rank) of one job and, for each communicator that
failed or whose ranks disagree: the last collective every rank completed, the first one
where the ranks diverge (who entered what, where in their code, who did not enter it), the
failure each rank raised, the root cause, and what to check. `diagnose` makes the report
(plain data: what `--json` prints), `render` the screen.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

from ._recorder import FORMAT, VERSION
from ._wording import call_words, ranks_text

__all__ = ["Dumps", "load", "diagnose", "render", "ranks_text", "call_text"]


class Dumps(NamedTuple):
    """The dumps of one job found in a directory."""

    directory: str
    job: str
    #: job rank -> its dump
    by_rank: dict[int, dict[str, Any]]
    #: files of the directory that are not dumps of this job (other jobs', unreadable)
    skipped: list[str]


def load(directory: str) -> Dumps:
    """The dumps of the newest job in `directory` (ValueError where there is none)."""
    documents: list[tuple[str, dict[str, Any]]] = []
    skipped = []
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        try:
            with open(path, encoding="utf-8") as f:
                document = json.load(f)
        except (OSError, ValueError):
            skipped.append(path)
            continue
        if not isinstance(document, dict) or document.get("format") != FORMAT:
            continue
        if document.get("version") != VERSION:
            skipped.append(path)
            continue
        documents.append((path, document))
    if not documents:
        raise ValueError(f"no flight recorder dumps (format {FORMAT!r}, version {VERSION}) "
                         f"in {directory}")
    newest = max(documents, key=lambda d: d[1]["written"])[1]["job"]
    by_rank: dict[int, dict[str, Any]] = {}
    for path, document in documents:
        if document["job"] != newest:
            skipped.append(path)
        elif document["rank"] not in by_rank or \
                document["written"] > by_rank[document["rank"]]["written"]:
            by_rank[document["rank"]] = document
    return Dumps(directory, newest, by_rank, skipped)


def call_text(entry: dict[str, Any]) -> str:
    """A recorded call in words: `all_reduce(float32[4096], op=sum)`."""
    shapes = entry.get("shapes") or [[]]
    return call_words(entry["verb"], shapes[0], entry.get("dtype"), entry.get("op"),
                      entry.get("root"))


def _site(entry: dict[str, Any]) -> str:
    site = entry.get("site") or ""
    path, _, line = site.rpartition(":")
    if path and os.path.isabs(path):
        relative = os.path.relpath(path)
        if not relative.startswith(".."):
            site = f"{relative}:{line}"
    return site or "an unknown place"


def _signature(entry: dict[str, Any]) -> tuple[Any, ...]:
    """What every rank must call alike (the recorder's view of it)."""
    return (entry["verb"], tuple(map(tuple, entry.get("shapes") or [])), entry.get("dtype"),
            entry.get("op"), entry.get("root"))


def _entered(entry: dict[str, Any]) -> dict[str, Any]:
    return {"call": call_text(entry), "site": _site(entry), "verb": entry["verb"],
            "shapes": entry.get("shapes"), "dtype": entry.get("dtype"), "op": entry.get("op"),
            "root": entry.get("root"), "schedule": entry.get("schedule")}


def _communicator(group: str, ranks: Sequence[int], records: dict[int, dict[str, Any] | None],
                  dead: Sequence[int]) -> dict[str, Any]:
    """The report of one communicator: `records` is each of its ranks' (job ranks) record
    of it (None: that rank's dump holds none of it); `dead`: ranks that left no dump."""
    here = {r: rec for r, rec in records.items() if rec is not None}
    entries = {r: {e["seq"]: e for e in rec["entries"]} for r, rec in here.items()}
    done = {r: max((s for s, e in es.items() if e["state"] == "done"), default=0)
            for r, es in entries.items()}
    common = min(done.values(), default=0)
    last: dict[str, Any] | None = None
    for r in sorted(entries):
        entry = entries[r].get(common)
        if entry is not None:
            last = {"seq": common, **_entered(entry)}
            break
    report: dict[str, Any] = {
        "group": group, "ranks": list(ranks), "no_dump": sorted(dead),
        "last_completed": last,
        "last_completed_by_rank": {str(r): done[r] for r in sorted(done)},
        "divergence": None,
        "failures": [{"rank": r, **rec["failure"]} for r, rec in sorted(here.items())
                     if rec.get("failure")],
        "states": {str(r): rec["state"] for r, rec in sorted(here.items())},
    }
    newest = max((max(es, default=0) for es in entries.values()), default=0)
    for seq in range(common + 1, newest + 1):
        calls: dict[tuple[Any, ...], list[int]] = {}
        missing, unknown = [], []
        for r in sorted(entries):
            entry = entries[r].get(seq)
            if entry is not None:
                calls.setdefault(_signature(entry), []).append(r)
            elif entries[r] and min(entries[r]) > seq:
                unknown.append(r)  # (its ring no longer holds it)
            else:
                missing.append(r)
        if len(calls) <= 1 and not missing:
            continue
        if not calls:
            break
        groups = sorted(calls.values(), key=lambda g: (-len(g), g[0]))
        report["divergence"] = {
            "seq": seq,
            "entered": [{"ranks": g, "states": sorted({entries[r][seq]["state"] for r in g}),
                         "sites": {str(r): _site(entries[r][seq]) for r in g},
                         **_entered(entries[g[0]][seq])} for g in groups],
            "not_entered": [{"rank": r, "last": _last_of(entries[r])} for r in missing],
            "not_recorded": unknown,
        }
        break
    report["root_cause"] = _root_cause(report, ranks)
    report["check"] = _advice(report)
    return report


def _last_of(entries: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    if not entries:
        return None
    entry = entries[max(entries)]
    return {"seq": entry["seq"], "state": entry["state"], **_entered(entry)}


def _root_cause(report: dict[str, Any], ranks: Sequence[int]) -> dict[str, Any] | None:
    """The rank(s) that caused the trouble, and why: ranks that called something else than
    the others, else ranks the failures blame, else ranks that left no dump, else ranks that
    did not enter the collective the others waited in."""
    divergence = report["divergence"]
    blamed: dict[int, int] = {}
    for failure in report["failures"]:
        if failure.get("blames") is not None and failure["blames"] != failure["rank"]:
            blamed[failure["blames"]] = blamed.get(failure["blames"], 0) + 1
    if divergence is not None and len(divergence["entered"]) > 1:
        groups = divergence["entered"]
        culprits = [r for g in groups[1:] for r in g["ranks"]]
        if len(groups[0]["ranks"]) == len(groups[1]["ranks"]) and blamed:  # no majority
            top = max(blamed.values())
            culprits = sorted(r for r, n in blamed.items() if n == top)
        theirs = next(g for g in groups if culprits[0] in g["ranks"])
        others = next(g for g in groups if g is not theirs)
        return {"ranks": culprits, "kind": "mismatch",
                "why": f"{ranks_text(theirs['ranks'])} called {theirs['call']} as "
                       f"#{divergence['seq']} where {ranks_text(others['ranks'])} called "
                       f"{others['call']}"}
    if blamed:
        top = max(blamed.values())
        culprits = sorted(r for r, n in blamed.items() if n == top)
        kind = "dead" if set(culprits) <= set(report["no_dump"]) else "blamed"
        return {"ranks": culprits, "kind": kind,
                "why": f"the failures of {ranks_text(_blamers(report, culprits))} blame "
                       f"{ranks_text(culprits)}"}
    if report["no_dump"]:
        return {"ranks": report["no_dump"], "kind": "dead",
                "why": f"{ranks_text(report['no_dump'])} left no dump (the process died, or "
                       f"its recorder is off)"}
    if divergence is not None and divergence["not_entered"]:
        culprits = [n["rank"] for n in divergence["not_entered"]]
        return {"ranks": culprits, "kind": "missing",
                "why": f"{ranks_text(culprits)} never entered #{divergence['seq']}, which "
                       f"the others waited in"}
    own = [f["rank"] for f in report["failures"] if f.get("blames") in (None, f["rank"])]
    if own:
        return {"ranks": own[:1], "kind": "own",
                "why": f"{ranks_text(own[:1])} failed on its own account"}
    return None


def _blamers(report: dict[str, Any], culprits: Sequence[int]) -> list[int]:
    return [f["rank"] for f in report["failures"] if f.get("blames") in culprits]


def _advice(report: dict[str, Any]) -> list[str]:
    """What to look at, given the root cause."""
    cause, divergence = report["root_cause"], report["divergence"]
    if cause is None:
        return []
    who = ranks_text(cause["ranks"])
    if cause["kind"] == "mismatch" and divergence is not None:
        groups = divergence["entered"]
        theirs = next(g for g in groups if cause["ranks"][0] in g["ranks"])
        majority = next(g for g in groups if g is not theirs)
        if theirs["verb"] != majority["verb"]:
            return [f"why {who} called {theirs['verb']} at {theirs['site']} where the others "
                    f"called {majority['verb']} at {majority['site']}: a branch, an early "
                    f"return or `continue`, or an exception caught, that depends on the rank "
                    f"or its data, makes the ranks' sequences of collectives differ"]
        return [f"the arguments {who} passed at {theirs['site']} ({theirs['call']}; the "
                f"others: {majority['call']}): every rank must pass the same shape, dtype, "
                f"op and root"]
    if cause["kind"] == "dead":
        return [f"{who}'s exit status and log: a process killed by a signal (the OOM "
                f"killer's SIGKILL, say) or ended by os._exit leaves no dump"]
    if cause["kind"] == "missing" and divergence is not None:
        return [f"what {who} did instead of entering #{divergence['seq']} "
                f"({divergence['entered'][0]['call']} at {divergence['entered'][0]['site']}): "
                f"its log, and its stack while it hangs (`kill -USR1 PID` writes its recorder; "
                f"py-spy dump --pid PID shows where it is)"]
    if cause["kind"] in ("blamed", "own"):
        failure = next((f for f in report["failures"] if f["rank"] in cause["ranks"]), None)
        said = f" (it raised {failure['type']}: {failure['message']})" if failure else ""
        return [f"{who}'s log and error{said}"]
    return []


def diagnose(dumps: Dumps) -> dict[str, Any]:
    """The report of every communicator of the job that failed or whose ranks diverge."""
    groups: dict[str, tuple[list[int], dict[int, dict[str, Any]]]] = {}
    for rank, document in dumps.by_rank.items():
        for record in document["communicators"]:
            ranks, records = groups.setdefault(record["group"], (record["ranks"], {}))
            records[rank] = record
    size = max((len(ranks) for ranks, _ in groups.values()), default=0)
    world = dumps.job if dumps.job in groups else None
    job_ranks = groups[world][0] if world is not None else sorted(dumps.by_rank)
    communicators = []
    for group in sorted(groups, key=lambda g: (g != dumps.job, g)):
        ranks, records = groups[group]
        dead = [r for r in ranks if r not in dumps.by_rank]
        report = _communicator(group, ranks, {r: records.get(r) for r in ranks
                                              if r in dumps.by_rank}, dead)
        troubled = report["failures"] or report["divergence"] is not None
        if troubled or group == dumps.job:
            communicators.append(report)
    return {"job": dumps.job, "directory": dumps.directory, "size": size,
            "ranks": list(job_ranks), "dumps": sorted(dumps.by_rank),
            "reasons": {str(r): d["reason"] for r, d in sorted(dumps.by_rank.items())},
            "skipped": dumps.skipped, "communicators": communicators}


def render(report: dict[str, Any]) -> str:
    """The report on one screen."""
    lines = [f"gpuring doctor: job {report['job']}: dumps of {ranks_text(report['dumps'])} "
             f"in {report['directory']}"]
    missing = sorted(set(report["ranks"]) - set(report["dumps"]))
    if missing:
        lines.append(f"  no dump of {ranks_text(missing)}")
    for comm in report["communicators"]:
        lines.append(f"communicator {comm['group']} ({ranks_text(comm['ranks'])}):")
        last = comm["last_completed"]
        if last is not None:
            lines.append(f"  last collective every rank completed: #{last['seq']} "
                         f"{last['call']} at {last['site']}")
        else:
            lines.append("  no collective completed on every rank")
        divergence = comm["divergence"]
        if divergence is not None:
            lines.append(f"  first divergence: #{divergence['seq']}")
            for group in divergence["entered"]:
                sites = set(group["sites"].values())
                where = group["site"] if len(sites) == 1 else \
                    ", ".join(f"rank {r} {s}" for r, s in group["sites"].items())
                lines.append(f"    {ranks_text(group['ranks'])} entered {group['call']} at "
                             f"{where} ({'/'.join(group['states'])})")
            for absent in divergence["not_entered"]:
                last_one = absent["last"]
                after = "" if last_one is None else (
                    f" (its last: #{last_one['seq']} {last_one['call']} at "
                    f"{last_one['site']}, {last_one['state']})")
                lines.append(f"    rank {absent['rank']} did not enter it{after}")
            if divergence["not_recorded"]:
                lines.append(f"    {ranks_text(divergence['not_recorded'])}: no longer in "
                             f"the recorder (raise GPURING_TRACE_ENTRIES)")
        if comm["no_dump"]:
            lines.append(f"  {ranks_text(comm['no_dump'])}: no dump")
        kinds: dict[str, list[int]] = {}
        for failure in comm["failures"]:
            kinds.setdefault(failure["type"], []).append(failure["rank"])
        if kinds:
            lines.append("  failures: " + "; ".join(f"{t} on {ranks_text(rs)}"
                                                    for t, rs in kinds.items()))
        cause = comm["root_cause"]
        if cause is not None:
            lines.append(f"  root cause: {ranks_text(cause['ranks'])}: {cause['why']}")
            own = next((f for f in comm["failures"] if f["rank"] in cause["ranks"]), None)
            if own is not None:
                lines.append(f"    its error: {own['type']}: {_short(own['message'])}")
        for advice in comm["check"]:
            lines.append(f"  check: {advice}")
    return "\n".join(lines)


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."
