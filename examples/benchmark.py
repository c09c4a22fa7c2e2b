"""Measure all_reduce on 2 ranks of this machine, draw it, and read the numbers back:

    python examples/benchmark.py [--ranks 2] [--max-bytes 64M] [--out bench-out]

It runs `gpuring bench` (the command line, nccl-tests' method: sizes 8 B up to --max-bytes,
every result checked) with --json and --plot, then reads the JSON the way a script of yours
would: one line per size with gpuring's time, its bus bandwidth and its efficiency against
the memory-bandwidth floor (the least time the bytes it must move allow on this machine).
Add `--peers mpi` and run it under mpiexec to set MPI beside it (see the bench's docs).
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--max-bytes", default="64M", help="largest size: 64M, 1G, 4096...")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per size")
    parser.add_argument("--out", default="bench-out", help="directory for the JSON and PNG")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out / "allreduce.json", out / "allreduce.png"
    subprocess.run([sys.executable, "-m", "gpuring", "bench", "all_reduce", "--ranks",
                    str(args.ranks), "-b", "8", "-e", args.max_bytes, "-n", str(args.iters),
                    "--device", "cpu", "--json", str(json_path), "--plot", str(png_path)],
                   check=True)

    doc = json.loads(json_path.read_text())
    assert doc["complete"] and doc["wrong_total"] == 0
    floors = {(f["size"], f["placement"]): f for f in doc["floor"]}
    print(f"\n{doc['settings']['ranks']} ranks on {doc['machine'].get('cpu', 'this CPU')}, "
          f"commit {doc['machine'].get('commit') or 'unknown'}:")
    print(f"{'size (B)':>12} {'time (us)':>10} {'busbw (GB/s)':>13} {'of the floor':>13}")
    for row in doc["results"]:
        if row["system"] != "gpuring" or row["placement"] != "out-of-place":
            continue
        floor = floors.get((row["size"], row["placement"]))
        share = f"{floor['efficiency_pct']:.0f} %" if floor else "-"
        print(f"{row['size']:>12} {row['time_us']:>10.1f} {row['busbw_GBps']:>13.3f} "
              f"{share:>13}")
    print(f"plot: {png_path}")


if __name__ == "__main__":
    main()
