"""Timing helpers shared by the benchmark scripts.

The pattern every script follows:

```python
compiled, compile_s = compile_jax(jax.jit(f), *args)  # compile time, separately
times = alternate({"nqfjax": lambda: compiled(*args), "peer": peer}, repeats=3)
print(compile_line("nqfjax", compile_s))
print(table(times))
print(ratio_line("peer", "nqfjax", times, target=5.0))
```

`alternate` warms every candidate up (untimed), then runs them in turn, round
after round, so that a slow spell of a shared machine hits all of them alike;
results are blocked on (`jax.block_until_ready`) before the clock stops.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable


def block(x):
    """Wait for any JAX arrays in `x` to be computed; return `x` (numpy passes)."""
    try:
        import jax
    except ImportError:  # pragma: no cover
        return x
    return jax.block_until_ready(x)


def time_call(fn: Callable[[], object]) -> tuple[float, object]:
    """Wall time of one call of `fn()` (blocked on its result), and the result."""
    start = time.perf_counter()
    out = block(fn())
    return time.perf_counter() - start, out


def compile_jax(jitted, *args, **kwargs):
    """Compile `jitted` (a `jax.jit` function) ahead of time for these arguments.

    **Returns:** `(compiled, seconds)`; call `compiled(*args, **kwargs)` to run it.
    """
    start = time.perf_counter()
    compiled = jitted.lower(*args, **kwargs).compile()
    return compiled, time.perf_counter() - start


def alternate(
    fns: dict[str, Callable[[], object]],
    *,
    repeats: int = 3,
    warmup: int | dict[str, int] = 1,
) -> dict[str, list[float]]:
    """Time each of `fns` `repeats` times, alternating between them, after `warmup`
    untimed calls of each (an int, or per name: e.g. 0 for a peer with no JIT).

    **Returns:** name -> list of wall times in seconds."""
    for name, fn in fns.items():
        n_warm = warmup.get(name, 1) if isinstance(warmup, dict) else warmup
        for _ in range(n_warm):
            block(fn())
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(time_call(fn)[0])
    return times


def summary(ts: list[float]) -> dict[str, float]:
    return dict(median=statistics.median(ts), min=min(ts), max=max(ts), n=len(ts))


def fmt_seconds(s: float) -> str:
    if s >= 100:
        return f"{s:.0f} s"
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1e3:.1f} ms"


def table(times: dict[str, list[float]], notes: dict[str, str] | None = None) -> str:
    """A plain-text table: name, median, min-max, repeats (and an optional note)."""
    notes = notes or {}
    width = max(len(n) for n in times)
    lines = [f"{'':{width}}  {'median':>9}  {'min - max':>21}  n"]
    for name, ts in times.items():
        s = summary(ts)
        note = f"  {notes[name]}" if name in notes else ""
        lines.append(
            f"{name:{width}}  {fmt_seconds(s['median']):>9}  "
            f"{fmt_seconds(s['min']):>9} - {fmt_seconds(s['max']):>9}  "
            f"{s['n']}{note}"
        )
    return "\n".join(lines)


def ratio(slow: list[float], fast: list[float]) -> float:
    """Median of `slow` over median of `fast` (how many times faster `fast` is)."""
    return statistics.median(slow) / statistics.median(fast)


def ratio_line(
    slow: str,
    fast: str,
    times: dict[str, list[float]],
    *,
    target: float | None = None,
) -> str:
    """`"<fast> is R x faster than <slow> (median over median) [target T: met]"`."""
    r = ratio(times[slow], times[fast])
    line = f"RATIO {fast} vs {slow}: {r:.2f}x faster (median / median)"
    if target is not None:
        line += f"; target >= {target:g}x: {'MET' if r >= target else 'NOT MET'}"
    return line


def compile_line(name: str, seconds: float) -> str:
    return f"compile {name}: {fmt_seconds(seconds)} (not included in the run times)"


def machine() -> str:
    """One line describing the machine and the library versions."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:  # pragma: no cover
        pass
    parts = [cpu, f"{os.cpu_count()} logical cores"]
    parts.append(f"Python {platform.python_version()}")
    for mod in ("jax", "diffrax", "numpy", "scipy", "torch"):
        if mod in sys.modules:  # report what the script uses, import nothing new
            parts.append(f"{mod} {getattr(sys.modules[mod], '__version__', '?')}")
    try:
        parts.append(f"load average {os.getloadavg()[0]:.1f}")
    except OSError:  # pragma: no cover
        pass
    return ", ".join(parts)


def make_parser(
    doc: str,
    *,
    quick_help: str = "small smoke run",
    toggles: tuple[tuple[str, str], ...] = (),
) -> argparse.ArgumentParser:
    """The command line every script shares: `--quick`, `--repeats N`,
    `--json PATH`, and each `(flag, help)` of `toggles` as an on/off switch
    (`--flag` / `--no-flag`, default: on unless `--quick`; read it with
    `enabled`). The description is the first line of `doc`."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--json", default=None, help="write the results here")
    for flag, help_ in toggles:
        parser.add_argument(
            f"--{flag}", action=argparse.BooleanOptionalAction, default=None, help=help_
        )
    return parser


def enabled(args: argparse.Namespace, flag: str) -> bool:
    """A toggle of `make_parser`: as given, else on unless `--quick`."""
    value = getattr(args, flag.replace("-", "_"))
    return (not args.quick) if value is None else bool(value)


def write_json(path: str | None, result: dict) -> None:
    """Write `result` to `path` (nothing when `path` is None)."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1, default=float)
