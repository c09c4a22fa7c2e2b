"""The harness of the one-command GPU device check, `bash bench/device_check.sh OUT`, which runs
these modules from the source tree (the repository root on PYTHONPATH):

* `probe` (`python -m tools.device_check.probe OUT.json`): what the GPU machine offers
  gpuring's design (CUDA IPC, stream memory operations, flag ping-pongs, a dead exporter,
  abort release, copy bandwidth, host cost, MPS), each part in a child process with its own
  time box; its parts are in `probe_parts` and `probe_faults`, named in `probe_registry`, and
  share `probe_gpu`.
* `check_summary` (`python -m tools.device_check.check_summary ...`): summary.txt from the
  steps' logs, probe.json and the benches' JSON (`summary_probe`, `summary_units`).
* `smoke` (`gpuring run -n 2 -- python -m tools.device_check.smoke`): a 2-rank all_reduce
  check of CuPy arrays for machines without pytest.

Not installed with gpuring: the library never imports this package.
"""
