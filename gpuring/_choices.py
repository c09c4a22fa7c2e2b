"""What a call runs where it asks for nothing itself: its algorithm, piece size and channels,
from the call, then the communicator's settings, then the tuning table (`gpuring tune`), then
the device's defaults; and deterministic mode's rule."""

from __future__ import annotations

import warnings
from typing import NamedTuple

from ._call import Call
from ._config import Config
from ._tuning import Choice, Tuning
from ._tuning import load as load_tuning

__all__ = ["Choices", "Picked", "FOLDS"]

#: the collectives that reduce, which deterministic mode and `algorithm` are about
FOLDS = frozenset({"all_reduce", "reduce_scatter", "reduce"})


class Picked(NamedTuple):
    """A call's algorithm (`plan_collective`'s), and its piece size and channels (None: the
    engine's and the device's defaults)."""

    algorithm: str
    chunk_bytes: int | None
    channels: int | None


class Choices:
    """A communicator's choices for the calls that leave them open."""

    def __init__(self, config: Config, size: int):
        self.config = config
        self.size = size
        #: the tuning table (GPURING_TUNING, `init(tuning=)`), and the device kinds it was
        #: found not to fit
        self.tuning: Tuning | None = (None if config.tuning is None
                                      else load_tuning(config.tuning))
        self._untuned: set[str] = set()

    @property
    def digest(self) -> str | None:
        """The tuning table's digest, which every rank's calls must agree on."""
        return None if self.tuning is None else self.tuning.digest

    def pick(self, call: Call, kind: str, nbytes: int) -> Picked:
        """What `call` (on `kind` arrays of `nbytes`) runs."""
        config = self.config
        tuned = self._tuned(call.collective, kind, nbytes)
        chunk = call.chunk_bytes or config.chunk_bytes or (tuned and tuned.chunk_bytes)
        channels = call.channels or config.channels or (tuned and tuned.channels)
        return Picked(self._algorithm(call, nbytes, tuned), chunk or None, channels or None)

    def _tuned(self, name: str, kind: str, nbytes: int) -> Choice | None:
        """The tuning table's choice for `name` of `nbytes` on `kind` (None: no table, or
        one that has no entry or was made for another device or rank count, which a warning
        says once)."""
        tuning = self.tuning
        if tuning is None:
            return None
        if not tuning.applies(kind, self.size):
            if kind not in self._untuned:
                self._untuned.add(kind)
                warnings.warn(f"gpuring: the tuning table {tuning.path} was made for "
                              f"{tuning.ranks} ranks on {tuning.device}; this communicator's "
                              f"{kind} collectives on {self.size} ranks do not use it",
                              RuntimeWarning, stacklevel=8)  # the caller of the verb
            return None
        return tuning.choose(name, nbytes)

    def _algorithm(self, call: Call, nbytes: int, tuned: Choice | None) -> str:
        """The schedule of `call` (`plan_collective`'s `algorithm`): the call's, else the
        communicator's, else the tuning table's (`tuned`); in deterministic mode, where none
        is asked for (or the table's is the ring), one that folds in rank order (one-shot for
        an all_reduce of up to GPURING_ONE_SHOT_BYTES, else two-shot). A ring asked for in
        deterministic mode is refused once the ranks agreed on it."""
        name, config = call.collective, self.config
        if name not in FOLDS:
            return "auto"
        asked = call.algorithm or config.algorithm
        if asked == "auto" and tuned is not None and not (
                config.deterministic and tuned.algorithm == "ring"):
            asked = tuned.algorithm
        if asked == "one_shot" and name != "all_reduce":  # GPURING_ALGORITHM's, all_reduce's
            asked = "auto"
        if config.deterministic and asked == "auto":
            small = name == "all_reduce" and 0 < nbytes <= config.one_shot_bytes
            asked = "one_shot" if small else "two_shot"
        return asked
