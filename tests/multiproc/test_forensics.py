"""When a job goes wrong, on real ranks: the flight recorder's dumps of a job whose hidden rank
skips a collective, and what `gpuring doctor` makes of them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import launch

WORKER = str(Path(__file__).parent / "worker_forensics.py")


def doctor(directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuring", "doctor", str(directory), *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["next", "stall"])
def test_doctor_names_the_rank_that_skipped_a_collective(case: str, tmp_path: Path) -> None:
    """8 ranks; rank 5 skips the all_gather of step 2 (#6): it calls its next all_reduce
    there (`next`), or no collective at all while the others time out (`stall`). Every rank
    fails and writes its dump; the doctor names rank 5 and the collective, where each rank
    was in its code, and rank 5 as the root cause."""
    traces = tmp_path / "traces"
    proc = launch("gpuring", 8, [WORKER, case, str(tmp_path)], grace=120, timeout=600,
                  env={"HIDDEN": "5", "GPURING_TRACE_DIR": str(traces),
                       "GPURING_TIMEOUT": "10", "GPURING_JITTER": "0"})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert sorted(p.name for p in tmp_path.glob("result-*.txt")) == [
        f"result-{r}.txt" for r in range(8)], out
    assert len(list(traces.glob("*.json"))) == 8, out
    report = doctor(traces)
    assert report.returncode == 0, report.stderr
    lines = report.stdout.splitlines()
    text = report.stdout
    worker = Path(WORKER).name
    assert "  last collective every rank completed: #5 all_reduce(float32[64], op=sum) at " \
           in text and f"{worker}:41" in text, text
    assert "  first divergence: #6" in lines, text
    # rank 5's all_reduce #6 (its next call) failed where it ran into its peers' all_gather,
    # or was refused (`stall`: called once the others had failed; or not yet told so)
    states = "(failed)" if case == "next" else ("(failed)", "(refused)")
    assert any(line.startswith("    ranks 0-4, 6-7 entered all_gather(float32[1]) at ")
               and line.endswith(f"{worker}:46 (failed)") for line in lines), text
    assert any(line.startswith("    rank 5 entered all_reduce(float32[64], op=sum) at ")
               and line.endswith(states) and f"{worker}:41 " in line for line in lines), text
    assert "  root cause: rank 5: rank 5 called all_reduce(float32[64], op=sum) as #6 where " \
           "ranks 0-4, 6-7 called all_gather(float32[1])" in lines, text
    as_json = json.loads(doctor(traces, "--json").stdout)
    (comm,) = [c for c in as_json["communicators"] if c["group"] == as_json["job"]]
    assert comm["root_cause"]["ranks"] == [5]
    assert comm["divergence"]["seq"] == 6
