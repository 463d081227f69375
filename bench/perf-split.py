#!/usr/bin/env python3
"""Split a server's CPU per unit of work by where it is spent.

    perf-split.py NAME=SCRIPT:US_PER_UNIT [NAME=SCRIPT:US_PER_UNIT ...]

Each SCRIPT is the text of `perf script` for a `perf record -g` of one
server (kernel call graphs are whole without frame pointers; user ones are
not needed here). A sample is put in one place: user space, by object
(the server's own code, libc, the vDSO); the kernel, by the system call
it is inside (`__x64_sys_NAME` or `ksys_NAME` on its stack, else the
function the system call entry called); the switch to
another task when the server is preempted on its way back from a system
call (`exit_to_user_mode_loop`); or the rest of the kernel (interrupts,
page faults). Shares are scaled by the CPU per unit the load generator
measured for that server (US_PER_UNIT), so the columns compare servers in
microseconds per unit. Prints one table, rows in order of the first
server's cost.
"""
import collections
import re
import sys

FRAME = re.compile(r"^\s+[0-9a-f]+\s+(.*) \((.*)\)$")
SYSCALL = re.compile(r"^(?:__x64_sys_|ksys_)(\w+)")
ENTRY = re.compile(r"^_*(?:x64_sys_|do_sys_|sys_)?")


def place(frames):
    """Where one sample's CPU went; frames run from the leaf outwards."""
    sym, dso = frames[0]
    if "kernel" not in dso:
        obj = dso.rsplit("/", 1)[-1]
        if obj.startswith("libc"):
            return "user: libc"
        if obj.startswith("[vdso]"):
            return "user: vdso (clock reads)"
        if obj.startswith("ld-linux") or obj.startswith("libm") or obj.startswith("libgcc"):
            return "user: other libraries"
        return "user: own code"
    names = [s for s, _ in frames]
    for s in names:
        m = SYSCALL.match(s)
        if m:
            return "kernel: " + m.group(1)
    # The system call's own function is the frame below the entry (its
    # `__x64_sys_` wrapper may be folded away, as for `__sys_sendmsg`).
    if "do_syscall_64" in names:
        below = [s for s in names[: names.index("do_syscall_64")] if s != "x64_sys_call"]
        if below and below[-1] == "exit_to_user_mode_loop":
            return "kernel: switch to another task (preempted)"
        if below:
            return "kernel: " + ENTRY.sub("", below[-1])
    if "exit_to_user_mode_loop" in names:
        return "kernel: switch to another task (preempted)"
    return "kernel: interrupts, faults, other"


def split(path):
    counts, frames, total = collections.Counter(), [], 0
    with open(path, errors="replace") as f:
        for line in f:
            m = FRAME.match(line)
            if m:
                frames.append((m.group(1).split("+0x")[0], m.group(2)))
                continue
            if not line.strip() and frames:
                counts[place(frames)] += 1
                total += 1
                frames = []
    if frames:
        counts[place(frames)] += 1
        total += 1
    return counts, total


def main(args):
    if not args:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    cols = []
    for a in args:
        name, rest = a.split("=", 1)
        path, us = rest.rsplit(":", 1)
        counts, total = split(path)
        if total == 0:
            print(f"{name}: no samples in {path}", file=sys.stderr)
            return 1
        cols.append((name, {k: float(us) * v / total for k, v in counts.items()}, float(us), total))
    rows = sorted({k for _, c, _, _ in cols for k in c}, key=lambda k: -cols[0][1].get(k, 0.0))
    print(f"{'µs per unit':46s}" + "".join(f"{n:>12s}" for n, _, _, _ in cols))
    for r in rows:
        vals = [c.get(r, 0.0) for _, c, _, _ in cols]
        if max(vals) < 0.05:
            continue
        print(f"{r:46s}" + "".join(f"{v:12.1f}" for v in vals))
    print(f"{'total (the load generator CPU per unit)':46s}" + "".join(f"{u:12.1f}" for _, _, u, _ in cols))
    print(f"{'samples':46s}" + "".join(f"{t:12d}" for _, _, _, t in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
