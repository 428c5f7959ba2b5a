"""Run a command and print its wall time and the peak resident memory of its
whole process tree (summed over the processes alive at each sample).

Usage: python .ci/measure.py LABEL -- COMMAND [ARGS...]
Exits with the command's status.
"""

import os
import subprocess
import sys
import time


def _tree_rss(root: int) -> int:
    """Resident bytes of `root` and all its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    page = os.sysconf("SC_PAGE_SIZE")
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{name}/statm") as f:
                resident = int(f.read().split()[1])
        except OSError:
            continue
        pid, ppid = int(name), int(fields[1])
        children.setdefault(ppid, []).append(pid)
        rss[pid] = resident * page
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += rss.get(pid, 0)
        stack.extend(children.get(pid, []))
    return total


def main() -> int:
    label, sep, *cmd = sys.argv[1:]
    assert sep == "--" and cmd, __doc__
    start = time.monotonic()
    proc = subprocess.Popen(cmd)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, _tree_rss(proc.pid))
        time.sleep(0.5)
    wall = time.monotonic() - start
    print(f"{label}: wall time {wall:.0f} s, peak memory {peak / 2**30:.2f} GiB")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
