"""The launches of the named items on NumPy arrays (the host device): one per launcher, rank
count and settings, each running every family tested there, so that the tests of several
subjects share it (each test file takes the ids of its own families: `named.params`)."""

from __future__ import annotations

from .named import Group

_REDUCTIONS = "cases_reductions"
_EXCHANGE = "cases_exchange"
_MESSAGES = "cases_messages"
_REGISTERED = "cases_registered"
_COMMUNICATORS = "cases_communicators"
_ATTACHED = "cases_attached"


def _qualified(*families: str) -> tuple[str, ...]:
    where = {"dtypes_ops": _REDUCTIONS, "sizes": _REDUCTIONS, "back_to_back": _REDUCTIONS,
             "deterministic": _REDUCTIONS, "two_shot": _REDUCTIONS, "again": _REDUCTIONS,
             "exchange": _EXCHANGE, "uneven": _EXCHANGE, "p2p": _MESSAGES,
             "messages": _MESSAGES, "group_orders": _MESSAGES,
             "registered": _REGISTERED, "split": _COMMUNICATORS, "mismatch": _COMMUNICATORS,
             "module_api": _COMMUNICATORS, "nodes": _COMMUNICATORS,
             "nodes_without_mpi": _COMMUNICATORS, "close_and_again": _COMMUNICATORS,
             "tuned": _COMMUNICATORS, "attached": _ATTACHED}
    return tuple(f"{where[f]}:{f}" for f in families)


#: (launcher, ranks, variant) -> the families run there. The variants: settings (below).
FAMILIES: dict[tuple[str, int, str], tuple[str, ...]] = {
    ("gpuring", 1, ""): ("dtypes_ops", "sizes", "exchange", "uneven", "p2p", "messages",
                         "split"),
    ("gpuring", 2, ""): ("dtypes_ops", "sizes", "back_to_back", "mismatch", "p2p", "messages",
                         "group_orders", "again"),
    ("gpuring", 3, ""): ("dtypes_ops", "two_shot", "mismatch", "module_api", "uneven", "p2p",
                         "messages", "group_orders", "again"),
    ("gpuring", 3, "staged_messages"): ("p2p", "messages", "group_orders"),
    ("gpuring", 4, ""): ("split", "group_orders"),
    ("gpuring", 5, ""): ("exchange", "group_orders"),
    ("gpuring", 2, "buffer8K"): ("back_to_back",),
    ("gpuring", 3, "nonblocking-buffer64K"): ("back_to_back",),
    ("gpuring", 2, "deterministic-buffer16K"): ("deterministic",),
    ("gpuring", 3, "deterministic-buffer256K"): ("deterministic",),
    ("gpuring", 3, "deterministic"): ("registered",),
    ("gpuring", 2, "attach64K"): ("attached",),
    ("gpuring", 3, "attach64K-jitter"): ("attached",),
    ("gpuring", 4, "attach64K"): ("attached",),
    ("gpuring", 3, "attach64K-refused_on_rank1"): ("attached",),
    ("gpuring", 3, "attach64K-deterministic"): ("attached",),
    ("mpiexec", 2, "attach64K"): ("attached",),
    ("mpiexec", 2, ""): ("dtypes_ops", "back_to_back", "mismatch", "registered", "exchange",
                         "again"),
    ("mpiexec", 3, ""): ("mismatch", "module_api", "p2p", "messages", "split"),
    ("mpiexec", 3, "deterministic-buffer256K"): ("deterministic", "uneven"),
    ("mpiexec", 3, "mpi_transport"): ("dtypes_ops", "back_to_back", "mismatch"),
    ("mpiexec", 4, "nodes_abab"): ("nodes", "dtypes_ops", "exchange", "p2p", "messages",
                                   "group_orders", "mismatch", "again"),
    ("mpiexec", 4, "nodes_aabb-deterministic-buffer256K"): ("deterministic",),
}

#: what each variant sets: GPURING_* settings, and simulated nodes (mpiexec)
VARIANTS: dict[str, tuple[dict[str, str], tuple[str, ...] | None]] = {
    "": ({}, None),
    "buffer8K": ({"GPURING_BUFFER_BYTES": "8K"}, None),
    "nonblocking-buffer64K": ({"GPURING_TEST_NONBLOCKING": "1",
                               "GPURING_BUFFER_BYTES": "64K"}, None),
    "deterministic": ({"GPURING_DETERMINISTIC": "1"}, None),
    "deterministic-buffer16K": ({"GPURING_DETERMINISTIC": "1",
                                 "GPURING_BUFFER_BYTES": "16K"}, None),
    "deterministic-buffer256K": ({"GPURING_DETERMINISTIC": "1",
                                  "GPURING_BUFFER_BYTES": "256K"}, None),
    "mpi_transport": ({"GPURING_TRANSPORT": "mpi"}, None),
    "staged_messages": ({"GPURING_MESSAGE_ATTACH": "0", "GPURING_MESSAGE_BYTES": "16K"},
                        None),
    "attach64K": ({"GPURING_ATTACH_BYTES": "64K"}, None),
    "attach64K-jitter": ({"GPURING_ATTACH_BYTES": "64K", "GPURING_JITTER": "1"}, None),
    "attach64K-refused_on_rank1": ({"GPURING_ATTACH_BYTES": "64K",
                                    "GPURING_TEST_ATTACH_REFUSED": "1"}, None),
    "attach64K-deterministic": ({"GPURING_ATTACH_BYTES": "64K",
                                 "GPURING_DETERMINISTIC": "1"}, None),
    "nodes_abab": ({}, ("a", "b", "a", "b")),
    "nodes_aabb-deterministic-buffer256K": ({"GPURING_DETERMINISTIC": "1",
                                             "GPURING_BUFFER_BYTES": "256K"},
                                            ("a", "a", "b", "b")),
}

#: the launches `pytest -m "not slow"` keeps: one rank, and two under `gpuring run`
QUICK = {("gpuring", 1, ""), ("gpuring", 2, ""), ("gpuring", 2, "attach64K")}


def on_host(n: int, launcher: str = "gpuring", variant: str = "") -> Group:
    """The launch of NumPy items on `n` ranks under `launcher` with `variant`'s settings."""
    env, nodes = VARIANTS[variant]
    tag = "-".join(part for part in (launcher if launcher != "gpuring" else "", variant)
                   if part)
    return Group(_qualified(*FAMILIES[(launcher, n, variant)]), n, launcher=launcher,
                 env=tuple(sorted(env.items())), nodes=nodes, tag=tag,
                 slow=(launcher, n, variant) not in QUICK)
