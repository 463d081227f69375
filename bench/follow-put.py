#!/usr/bin/env python3
"""Keep Palisade where the shared harness means to place it.

    sudo bench/follow-put.py -- ../shared/bench/run-palisade.sh [ARGS]

Runs the command (the shared harness) and, while it runs, gives every
Palisade process started by the harness's adapter (`palisade-put.sh`) the
CPU affinity of that adapter, its parent.

Why: for its concurrency-1 runs the harness moves the proxy under test onto
the client's core with `taskset -a -p CPU PID`, where PID is the adapter's
shell. `-a` moves that process's threads, not its children, so Palisade
(the adapter's child) stays on the proxy's core while the load generator
and the origin run on the other: every hop of a c=1 tunnel becomes a
cross-core wake-up (50-100 us each on a 2-vCPU VM), which the harness
avoids for every other proxy. HAProxy and squid are the harness's own
children and move as intended. The DNS adapter execs Palisade, so DNS
runs are placed right without this.

The follower reads the adapter's affinity every 20 ms and copies it to
each of Palisade's threads when they differ (the harness warms up for
0.5 s before it measures). It forks nothing and is not in the proxy's
process tree, so the harness does not count its CPU as the proxy's.
Each change is logged to stderr. Bounded: it stops with the command.
"""
import os
import subprocess
import sys
import time

POLL = 0.02
SCAN = 0.25


def comm(pid):
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def parent(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def palisades():
    """Palisade processes whose parent is the harness's adapter script."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or comm(d) != "palisade":
            continue
        ppid = parent(d)
        if ppid and "palisade-put.sh" in cmdline(ppid):
            found.append((int(d), ppid))
    return found


def follow(pid, ppid):
    try:
        want = os.sched_getaffinity(ppid)
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for t in tids:
        try:
            if os.sched_getaffinity(int(t)) != want:
                os.sched_setaffinity(int(t), want)
                print(f"follow-put: palisade {pid} thread {t} -> cpus {sorted(want)}",
                      file=sys.stderr, flush=True)
        except OSError:
            pass


def main():
    args = sys.argv[1:]
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    child = subprocess.Popen(args)
    procs, last_scan = [], 0.0
    while child.poll() is None:
        now = time.monotonic()
        if now - last_scan >= SCAN:
            procs, last_scan = palisades(), now
        for pid, ppid in procs:
            follow(pid, ppid)
        time.sleep(POLL)
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
