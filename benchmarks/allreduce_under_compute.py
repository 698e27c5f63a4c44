"""Does a CPU all-reduce slow down while its ranks compute? Two gloo ranks on this host's
loopback (two devices of one emulated node) time the executor's two-member ring all-reduce
(execute/collectives.py) of one gradient bucket, in a background thread as the executor
launches it (execute/sync.py), on idle ranks and while each rank's main thread runs paced
compute (one-thread matmuls, then a wait so that it is busy 1/slowdown of the time, as an
emulated device's rank is). Rounds alternate the two conditions (idle loaded, loaded idle …).

Why: the simulator lets communication overlap compute fully without slowing it (on a GPU NCCL
runs beside the kernels), and the intra-node link is measured with idle ranks
(profile/links.py); on these CPUs gloo's copies and reductions share the cores with the
compute they overlap.

    python benchmarks/allreduce_under_compute.py [--megabytes 16.4] [--slowdowns 3,6] [--rounds 8]

Prints a table and writes benchmarks/results/allreduce_under_compute.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def rank_main(rank: int, port: int, numel: int, slowdown: float, rounds: int, out: str) -> None:
    from concurrent.futures import ThreadPoolExecutor
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from heterog.execute.collectives import ProcessGroupCache, allreduce_sum
    from heterog.execute.emulation import Pacer

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    groups = ProcessGroupCache(timeout_s=60)
    groups.create_all([[0, 1]])
    flat, a = torch.ones(numel), torch.randn(256, 256)
    pool, pacer = ThreadPoolExecutor(max_workers=1), Pacer(slowdown)

    def one(loaded: bool) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        done = pool.submit(allreduce_sum, flat, [0, 1], "ring", None, groups)
        while loaded and not done.done():  # paced compute until the all-reduce is done
            c0, w0 = time.thread_time(), time.perf_counter()
            for _ in range(4):
                a @ a
            pacer.pace(time.perf_counter() - w0, time.thread_time() - c0)
        done.result()
        return time.perf_counter() - t0

    one(False)  # warm-up: connections, buffers
    times: dict[str, list[float]] = {"idle": [], "loaded": []}
    for r in range(rounds):
        for mode in ("idle", "loaded") if r % 2 == 0 else ("loaded", "idle"):
            times[mode].append(one(mode == "loaded"))
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def measure(numel: int, slowdown: float, rounds: int) -> dict[str, list[float]]:
    from heterog.profile.links import _free_port

    with tempfile.TemporaryDirectory(prefix="heterog-overlap-") as tmp:
        out, port = Path(tmp) / "times.json", _free_port()
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--rank",
                    str(r),
                    "--port",
                    str(port),
                    "--numel",
                    str(numel),
                    "--slowdown",
                    str(slowdown),
                    "--rounds",
                    str(rounds),
                    "--rank-out",
                    str(out),
                ],
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
            for r in (0, 1)
        ]
        if any(p.wait(timeout=300) for p in procs) or not out.exists():
            raise SystemExit(f"a rank failed (slowdown {slowdown}); see its output above")
        return json.loads(out.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--megabytes", type=float, default=16.4, help="bucket size (toy-cnn's classifier: 16.4)")
    ap.add_argument("--slowdowns", default="3,6")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "allreduce_under_compute.json"))
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--numel", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--slowdown", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--rank-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.port, args.numel, args.slowdown, args.rounds, args.rank_out)
        return 0
    from heterog.cli.output import print_table
    from heterog.jsonio import write_atomic

    numel = int(args.megabytes * 1e6 / 4)
    rows, doc = (
        [],
        {
            "bytes": numel * 4,
            "rounds": args.rounds,
            "load_average_before": os.getloadavg(),
            "command": "python benchmarks/allreduce_under_compute.py " + " ".join(sys.argv[1:]),
            "by_slowdown": {},
        },
    )
    for k in (float(x) for x in args.slowdowns.split(",")):
        t = measure(numel, k, args.rounds)
        idle, loaded = statistics.median(t["idle"]), statistics.median(t["loaded"])
        doc["by_slowdown"][f"{k:g}"] = {
            "idle_s": t["idle"],
            "loaded_s": t["loaded"],
            "median_idle_s": idle,
            "median_loaded_s": loaded,
            "loaded_over_idle": loaded / idle,
        }
        rows.append([f"{k:g}×", f"{idle * 1e3:.1f} ms", f"{loaded * 1e3:.1f} ms", f"{loaded / idle:.2f}×"])
    doc["load_average_after"] = os.getloadavg()
    print_table(
        f"two-member ring all-reduce of {numel * 4 / 1e6:.1f} MB on loopback, median of {args.rounds}",
        ["ranks paced", "idle ranks", "ranks computing", "slower by"],
        rows,
    )
    write_atomic(args.out, json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
