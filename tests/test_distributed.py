"""`nqfjax.sweep` over several processes (`jax.distributed`, CPU devices, gloo),
each a real subprocess (`_sweep_worker.py`) against a coordinator on 127.0.0.1:
one sweep run by two processes together, one of them killed mid-sweep and both
restarted, equal bit for bit to one process over the same mesh; processes that see
different checkpoint folders; processes called with different grids; and the
optimized chunk program, which must hold no collective inside its loops."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest


HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "_sweep_worker.py")
CHUNK = 4  # _sweep_worker.CHUNK: 24 points, 6 chunks


def _env(devices: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(
        JAX_PLATFORMS="cpu",
        PYTHONPATH=ROOT,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
    )
    return env


# processes that each import jax and compile the sweep, waiting on one another
# over TCP: the slow tier
pytestmark = pytest.mark.slow

_STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_process_left():
    """Kill any worker a failed test left running."""
    yield
    while _STARTED:
        proc = _STARTED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(args_of, devices: int, processes: int = 2) -> list[subprocess.Popen]:
    """Start `processes` workers (`args_of(p)` their arguments) sharing a new
    coordinator."""
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, *args_of(p)]
            + ["--process", str(p), "--processes", str(processes), "--port", str(port)],
            env=_env(devices),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for p in range(processes)
    ]
    _STARTED.extend(procs)
    return procs


def _finish(procs, timeout=240) -> list[tuple[int, str]]:
    out = []
    for proc in procs:
        _, err = proc.communicate(timeout=timeout)
        out.append((proc.returncode, err))
    return out


def _reference(tmp_path, devices: int, engine: str = "solve_lv") -> dict:
    """One process over a mesh of `devices` CPU devices, no checkpoint."""
    out = tmp_path / f"reference{devices}.npz"
    proc = subprocess.run(
        [sys.executable, WORKER, "", "", str(out), "", "--engine", engine],
        env=_env(devices),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(np.load(out))


def _kill_mid_sweep(procs, victim: int, checkpoint, gate) -> None:
    """Once process 0 has checkpointed chunks 0 and 1 (chunk 2 waits on the gate),
    SIGKILL process `victim`, open the gate, and check that the survivor fails
    (at its next collective) without writing another chunk."""
    deadline = time.monotonic() + 240
    first_two = [checkpoint / f"chunk_{i:06d}.npz" for i in (0, 1)]
    while not all(p.exists() for p in first_two) or len(_manifest(checkpoint)) < 2:
        for proc in procs:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the workers made no progress"
        time.sleep(0.05)
    procs[victim].send_signal(signal.SIGKILL)
    gate.write_text("open")
    (survivor,) = [p for k, p in enumerate(procs) if k != victim]
    survivor.communicate(timeout=240)
    assert procs[victim].wait(timeout=60) == -signal.SIGKILL
    assert survivor.returncode != 0  # it cannot finish the sweep alone
    assert sorted(_manifest(checkpoint)) == ["000000", "000001"]


def _manifest(folder) -> dict:
    try:
        return json.loads((folder / "manifest.json").read_text())["chunks"]
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _evaluated(*logs) -> list[int]:
    return sorted(
        int(x) for log in logs if log.exists() for x in log.read_text().split()
    )


def _assert_equal_bits(result: dict, reference: dict) -> None:
    names = [k for k in reference if k not in _COUNTS]
    assert "loss" in names and "final" in names
    for name in names:
        np.testing.assert_array_equal(result[name], reference[name], err_msg=name)


_COUNTS = ("n_loaded", "n_computed", "devices", "shard_size")


# The library's own engines run at every point (`solve_lv`: an adaptive solve whose
# step count differs between points; `train`: gradient descent of a perceptron).
@pytest.mark.parametrize("engine", ["solve_lv", "train"])
def test_two_processes_killed_and_resumed_equal_one_process(tmp_path, engine):
    checkpoint, gate = tmp_path / "ckpt", tmp_path / "gate"
    logs = [tmp_path / f"log{p}" for p in range(2)]
    outs = [tmp_path / f"out{p}.npz" for p in range(2)]

    def args_of(p, dump=""):
        extra = ["--dump", str(dump)] if dump and p == 0 else []
        return [
            *(str(checkpoint), str(logs[p]), str(outs[p]), str(gate)),
            *("--engine", engine, *extra),
        ]

    # one device per process: a mesh of 2 devices over 2 processes; kill process 1
    _kill_mid_sweep(_launch(args_of, devices=1), 1, checkpoint, gate)
    for log in logs:
        log.unlink()

    hlo = tmp_path / "hlo"
    procs = _launch(lambda p: args_of(p, dump=hlo), devices=1)
    for status, err in _finish(procs):
        assert status == 0, err[-3000:]
    results = [dict(np.load(out)) for out in outs]
    for result in results:  # chunks 0-1 loaded, the other 4 computed, in each
        assert (int(result["n_loaded"]), int(result["n_computed"])) == (2, 4)
        # 4 points per chunk, a shard of 2 points on each process's device
        assert len(set(result["devices"])) == 2 and int(result["shard_size"]) == 2
    # every point of chunks 2-5 evaluated once, over both processes; none before
    assert _evaluated(*logs) == list(range(2 * CHUNK, 24))
    # every process has all results, equal bit for bit to one process with the
    # same mesh (2 devices), whose points run the same XLA CPU kernels
    reference = _reference(tmp_path, devices=2, engine=engine)
    for result in results:
        _assert_equal_bits(result, reference)
    # the init scale changes the curves (the equality is not trivial)
    mid = reference["loss"][:, 4]
    assert np.ptp(mid) > 0.01 * np.max(np.abs(mid))
    if engine == "solve_lv":  # the solves' loops have different lengths
        assert np.ptp(reference["steps"]) > 5

    # the optimized chunk program: no collective inside its while loops (nor
    # anywhere: the gather runs after it), where a plain sharded jit of the same
    # function all-reduces an adaptive loop's condition at every step (train's
    # loop has a fixed length, which needs no collective either way)
    sweep_hlo, jit_hlo = (hlo / "sweep.hlo").read_text(), (hlo / "jit.hlo").read_text()
    assert _loop_collectives(sweep_hlo) == set() and _collectives(sweep_hlo) == set()
    assert "while" in sweep_hlo
    if engine == "solve_lv":  # a loop whose trip count depends on the point
        assert "all-reduce" in _loop_collectives(jit_hlo)


def test_processes_with_different_checkpoint_folders(tmp_path):
    """Two processes of two devices each; process 1 sees a folder of its own
    (no shared file system), holding a foreign manifest, a damaged chunk 0 and a
    true copy of chunk 1. Process 0 is killed mid-sweep; after the restart,
    process 1 must use only what matches process 0's hashes."""
    folders = [tmp_path / "ckpt0", tmp_path / "ckpt1"]
    gate = tmp_path / "gate"
    outs = [tmp_path / f"out{p}.npz" for p in range(2)]

    def args_of(p):
        return [str(folders[p]), "", str(outs[p]), str(gate)]

    _kill_mid_sweep(_launch(args_of, devices=2), 0, folders[0], gate)
    assert not folders[1].exists() or not list(folders[1].iterdir())  # 1 never writes

    folders[1].mkdir(exist_ok=True)
    foreign = {"fingerprint": "0" * 64, "chunks": {}}
    (folders[1] / "manifest.json").write_text(json.dumps(foreign))
    (folders[1] / "chunk_000000.npz").write_bytes(b"not a chunk")
    chunk1 = (folders[0] / "chunk_000001.npz").read_bytes()
    (folders[1] / "chunk_000001.npz").write_bytes(chunk1)
    before = {p.name: p.read_bytes() for p in folders[1].iterdir()}

    for status, err in _finish(_launch(args_of, devices=2)):
        assert status == 0, err[-3000:]
    reference = _reference(tmp_path, devices=4)
    for out in outs:
        result = dict(np.load(out))
        assert (int(result["n_loaded"]), int(result["n_computed"])) == (2, 4)
        assert len(set(result["devices"])) == 4 and int(result["shard_size"]) == 1
        _assert_equal_bits(result, reference)
    # process 1 wrote nothing into its folder
    assert {p.name: p.read_bytes() for p in folders[1].iterdir()} == before
    assert len(_manifest(folders[0])) == 6


def test_processes_called_differently_refuse(tmp_path):
    outs = [tmp_path / f"out{p}.npz" for p in range(2)]

    def args_of(p):
        shift = ["--shift", "0.5"] if p == 1 else []
        return [str(tmp_path / "ckpt"), "", str(outs[p]), "", *shift]

    for status, err in _finish(_launch(args_of, devices=1)):
        assert status != 0
        assert "ValueError: process(es) [1] called `sweep` with arguments" in err, err
    assert not any(out.exists() for out in outs)
    assert not _manifest(tmp_path / "ckpt")


# --------------------------------------------------------------------------------
# reading optimized HLO

_COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "all-to-all",
    "collective-permute",
    "reduce-scatter",
    "collective-broadcast",
)
_CALLED = re.compile(r"(?:condition|body|to_apply|calls)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def _computations(hlo: str) -> dict[str, str]:
    """Computation name -> its text, from an HLO module's text."""
    out, name = {}, None
    for line in hlo.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            words = line.replace("ENTRY ", "").split()
            name = words[0].lstrip("%")
            out[name] = ""
        elif name is not None:
            out[name] += line + "\n"
    return out


def _collectives(text: str) -> set[str]:
    return {op for op in _COLLECTIVES if re.search(rf"\b{op}(-start)?\(", text)}


def _loop_collectives(hlo: str) -> set[str]:
    """The collectives in the computations a `while` runs (its condition, its
    body, and everything they call)."""
    comps = _computations(hlo)
    seen, todo = set(), []
    for text in comps.values():
        for line in text.splitlines():
            if " while(" in line:
                todo += re.findall(r"(?:condition|body)=%?([\w.\-]+)", line)
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        todo += _CALLED.findall(comps[name])
        for group in _BRANCHES.findall(comps[name]):
            todo += [g.strip().lstrip("%") for g in group.split(",")]
    assert seen, "no while loop found"
    return set().union(*(_collectives(comps[name]) for name in seen))
