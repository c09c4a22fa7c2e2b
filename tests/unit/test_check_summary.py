"""summary.txt of the device check from what a cut-short run leaves: no probe.json, a bench
without its JSON, a failed step (the end-to-end dry run is tests/multiproc/test_device_check.py)."""

from __future__ import annotations

import json
from pathlib import Path

from tools.device_check.check_summary import summarize

HEADER = "step\tstatus\trc\tseconds\tbudget\tlog\tnote\n"
_IN_PLACE = "        30.00     0.03     0.03      0"
TABLE = "\n".join([
    "# gpuring bench all_reduce: 2 ranks",
    "#       size        count     type  redop  root       time    algbw    busbw #wrong",
    "        1024          256  float32    sum    -1      35.00     0.03     0.03      0"
    + _IN_PLACE,
    "     1048576       262144  float32    sum    -1     100.00    10.49    10.49      0"
    + _IN_PLACE,
    ""])


def _stage(tmp_path: Path, steps: list[str]) -> Path:
    stage = tmp_path / "stage"
    stage.mkdir()
    (stage / "steps.tsv").write_text(HEADER + "".join(line + "\n" for line in steps))
    return stage


def test_a_run_cut_short(tmp_path: Path) -> None:
    stage = _stage(tmp_path, ["env\tok\t0\t1\t15\tenv.txt\t",
                              "allreduce-2ranks\ttimeout\t124\t50\t50\tallreduce-2ranks.txt\t"])
    (stage / "allreduce-2ranks.txt").write_text(TABLE + "killed\n")
    notes = tmp_path / "notes.txt"
    notes.write_text("# a comment\n- look at this\n")
    text = summarize(stage, tmp_path / "missing.json", notes, 1, 77)
    assert "result: FAIL (exit status 1) in 77 s; not ok: allreduce-2ranks" in text
    assert "probe.json is missing or unreadable" in text
    assert "-- last lines of allreduce-2ranks.txt (allreduce-2ranks, timeout):" in text
    assert "   killed" in text
    assert "no JSON: gpuring rows of the partial table" in text
    assert "1 MiB       100.0 us, 10.5 GB/s" in text
    assert "35.0 us, 0.030 GB/s" in text
    assert "- look at this" in text and "a comment" not in text
    assert "CUDA SIMULATOR" not in text


def test_probe_parts_that_did_not_finish(tmp_path: Path) -> None:
    probe = {
        "complete": True, "host": {"commit": "abc", "nvidia_smi": "not on PATH"},
        "versions": {"status": "ok", "gpu": "unavailable: AttributeError: x", "simulated": True},
        "ipc": {"status": "error", "error": "CUDARuntimeError: cudaErrorMapBufferObjectFailed"},
        "pingpong_memops": {"status": "timeout", "elapsed_s": 15.0, "samples": 300,
                            "round_trips": 1000, "median_us": 12.5, "p99_us": 40.0},
        "pingpong_kernel": {"status": "hang", "error": "Hang: batch 0", "round_trips": 1000},
        "mps": {"status": "skipped", "reason": "nvidia-cuda-mps-control is not on PATH"},
    }
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(probe))
    text = summarize(_stage(tmp_path, []), path, tmp_path / "none.txt", 0, 5)
    assert "CUDA SIMULATOR" in text and "GPU n/a" in text
    assert "ipc        ERROR: CUDARuntimeError: cudaErrorMapBufferObjectFailed" in text
    assert "memops         median   12.5 us  p99   40.0 us  (300 of 1000 round trips) -- " \
           "timeout" in text
    assert "spin kernels   hang: Hang: batch 0" in text
    assert "MPS: skipped (nvidia-cuda-mps-control is not on PATH)" in text
    assert "copy_bandid" not in text and "copy_bandwidth missing from probe.json" in text
