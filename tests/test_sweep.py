import hashlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import nqfjax
from nqfjax import grid_product
from nqfjax.sweep import CheckpointWarning


HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import _sweep_worker  # noqa: E402


def _lv_curve(log_sigma, dtype):
    """Loss curve of a 3-mode interacting LV system from `m0 = sigma^2 (1, 2, 3)`."""
    r = jnp.array([1.0, 0.5, 0.2], dtype)
    B = jnp.array([[1.0, 0.2, 0.1], [0.2, 1.0, 0.3], [0.1, 0.3, 0.8]], dtype)
    lv = nqfjax.LotkaVolterra(r, B)
    m0 = jnp.exp(2 * log_sigma) * jnp.arange(1.0, 4.0, dtype=dtype)
    ts = jnp.linspace(1.0, 80.0, 9, dtype=dtype)
    # Tsit5: this small problem is not stiff, and it compiles faster than Kvaerno5.
    return nqfjax.solve_lv(lv, m0, ts, solver=diffrax.Tsit5()).loss


@pytest.mark.slow  # a long physics check (the slow tier)
@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32])
def test_sweep_equals_separate_runs(dtype):
    traces = []

    def fn(log_sigma):
        traces.append(1)
        return {"loss": _lv_curve(log_sigma, dtype), "log_sigma": log_sigma}

    log_sigmas = np.linspace(-12.0, -2.0, 32).astype(dtype)
    result = nqfjax.sweep(fn, {"log_sigma": log_sigmas}, chunk=7, progress=False)
    # 32 points in chunks of 7: 5 chunks, the last padded from 4 to 7 points, and
    # one trace for all of them (same chunk shape every call).
    assert result.n_chunks == 5 and result.n_computed == 5 and result.n_loaded == 0
    assert len(traces) == 1
    assert result.outputs["loss"].shape == (32, 9)
    assert result.outputs["loss"].dtype == dtype
    np.testing.assert_array_equal(result.outputs["log_sigma"], log_sigmas)
    np.testing.assert_array_equal(result.grid["log_sigma"], log_sigmas)

    single = jax.jit(lambda s: _lv_curve(s, dtype))
    separate = np.stack([np.asarray(single(s)) for s in log_sigmas])
    # Same solver and tolerances; the batched solve only reorders floating-point
    # operations, which the adaptive step controller can amplify up to about the
    # solver tolerance (1e-9 float64, 1e-5 float32): compare well inside it.
    rtol = 1e-8 if dtype == jnp.float64 else 1e-4
    np.testing.assert_allclose(result.outputs["loss"], separate, rtol=rtol)
    # The init scale changes the curve (the comparison is not trivially equal).
    assert np.ptp(separate[:, 3]) > 0.01


def test_grid_product_order():
    a, b = np.array([1.0, 2.0, 3.0]), np.array([10.0, 20.0])
    grid = grid_product({"a": a, "b": b})
    result = nqfjax.sweep(lambda a, b: a * b + a, grid, progress=False)
    np.testing.assert_allclose(
        np.asarray(result.outputs).reshape(3, 2), a[:, None] * b[None, :] + a[:, None]
    )
    assert len(result) == 6


def test_bad_grids_and_mesh():
    f = lambda x: x
    with pytest.raises(ValueError, match="empty"):
        nqfjax.sweep(f, {})
    with pytest.raises(ValueError, match="empty"):
        nqfjax.sweep(f, {"x": np.array([])})
    with pytest.raises(ValueError, match="NaN"):
        nqfjax.sweep(f, {"x": np.array([1.0, np.nan])})
    with pytest.raises(ValueError, match="same leading length"):
        nqfjax.sweep(lambda x, y: x + y, {"x": np.ones(3), "y": np.ones(4)})
    with pytest.raises(ValueError, match="numeric"):
        nqfjax.sweep(f, {"x": np.array(["a", "b"])})
    with pytest.raises(ValueError, match="scalar"):
        nqfjax.sweep(f, {"x": 1.0})
    with pytest.raises(ValueError, match="dict"):
        nqfjax.sweep(f, [1.0, 2.0])
    with pytest.raises(ValueError, match="chunk"):
        nqfjax.sweep(f, {"x": np.ones(3)}, chunk=0)
    with pytest.raises(ValueError, match="empty"):
        grid_product({"a": np.ones(2), "b": []})
    mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
    with pytest.raises(ValueError, match="no axis named 'sweep'"):
        nqfjax.sweep(f, {"x": np.ones(3)}, mesh=mesh)
    # ... and naming the axis works (one device: the sweep axis is on it).
    out = nqfjax.sweep(
        f, {"x": np.arange(3.0)}, mesh=mesh, axis_name="batch", progress=False
    )
    np.testing.assert_array_equal(out.outputs, np.arange(3.0))


def test_checkpoint_from_other_sweep(tmp_path):
    f = lambda x: 2 * x
    first = nqfjax.sweep(
        f, {"x": np.arange(6.0)}, checkpoint=tmp_path, chunk=2, progress=False
    )
    assert (first.n_computed, first.n_loaded) == (3, 0)
    again = nqfjax.sweep(
        f, {"x": np.arange(6.0)}, checkpoint=tmp_path, chunk=2, progress=False
    )
    assert (again.n_computed, again.n_loaded) == (0, 3)
    np.testing.assert_array_equal(again.outputs, 2 * np.arange(6.0))
    with pytest.raises(ValueError, match="different sweep"):
        nqfjax.sweep(f, {"x": np.arange(6.0) + 1}, checkpoint=tmp_path, chunk=2)
    with pytest.raises(ValueError, match="different sweep.*chunk"):
        nqfjax.sweep(f, {"x": np.arange(6.0)}, checkpoint=tmp_path, chunk=3)
    with pytest.raises(ValueError, match="different sweep"):
        nqfjax.sweep(
            lambda x: (x, x), {"x": np.arange(6.0)}, checkpoint=tmp_path, chunk=2
        )


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, **extra)
    return env


# The library's own engines swept over a mesh of two host devices, against the same
# sweep without a mesh, in float64 and float32; then a bad point inside the mesh.
_SHARDED = textwrap.dedent(
    """
    import json, sys, tempfile
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import Mesh
    import nqfjax

    assert jax.device_count() == 2, jax.devices()
    jax.config.update("jax_enable_x64", sys.argv[1] == "float64")
    mesh = Mesh(np.array(jax.devices()), ("sweep",))
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(16, 4))
    ys = xs @ (0.3 * rng.normal(size=(2, 4))).T
    net = nqfjax.Perceptron(d=4, k=2)
    task = nqfjax.task_from_samples(net, xs, ys)
    lv = nqfjax.LotkaVolterra(jnp.array([1.0, 0.5, 0.2]),
                              jnp.array([[1.0, 0.2, 0.1], [0.2, 1.0, 0.3],
                                         [0.1, 0.3, 0.8]]))
    ts = jnp.linspace(1.0, 80.0, 6)
    quad = nqfjax.gaussian_quadratic_task(jnp.diag(jnp.array([1.0, 0.5, 0.25])),
                                          jnp.diag(jnp.array([1.0, 0.6, 0.3])))
    W0 = 0.1 * jnp.asarray(rng.normal(size=(net.p, 4)))

    def train(model, optimizer):
        def fn(log_sigma):
            res = nqfjax.train(net, xs, ys, num_steps=200, learning_rate=0.05,
                               optimizer=optimizer, model=model,
                               init_scale=jnp.exp(log_sigma), width=4,
                               key=jax.random.key(0), num_records=8)
            return {"loss": res.loss, "M": res.M[-1]}
        return fn

    def lv_batch(log_sigma):
        m0 = jnp.exp(2 * log_sigma) * jnp.array([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]])
        return nqfjax.solve_lv_batch(lv, m0, ts).loss

    engines = {
        "train": train(nqfjax.Layer(), None),
        "train_adam_quadratic": train(nqfjax.QuadraticForm(), optax.adam),
        "solve_lv": lambda log_sigma: nqfjax.solve_lv(
            lv, jnp.exp(2 * log_sigma) * jnp.arange(1.0, 4.0), ts).loss,
        "solve_lv_batch": lv_batch,
        "solve_mflow": lambda log_sigma: nqfjax.solve_mflow(
            task, jnp.exp(2 * log_sigma) * W0 @ W0.T, ts, 0.5).loss,
        "sgd_moments": lambda log_sigma: nqfjax.sgd_moments(
            quad, jnp.full(50, 0.05), jnp.full(50, 8.0),
            jnp.exp(2 * log_sigma) * jnp.ones(3), num_samples=64).loss,
    }
    if sys.argv[1] == "float32":  # the engines users run most, in float32
        engines = {name: engines[name] for name in ("train", "solve_lv")}
    grid = {"log_sigma": np.linspace(-6.0, -2.0, 6)}
    out = {}
    for name, fn in engines.items():
        plain = nqfjax.sweep(fn, grid, chunk=4, progress=False)
        sharded = nqfjax.sweep(fn, grid, mesh=mesh, chunk=4, progress=False)
        out[name] = {
            "plain": jax.tree.map(lambda a: np.asarray(a).tolist(), plain.outputs),
            "sharded": jax.tree.map(lambda a: np.asarray(a).tolist(),
                                    sharded.outputs),
            "devices": list(sharded.devices), "shard_size": sharded.shard_size,
            "per_device": sharded.per_device,
        }

    # a bad point inside the mesh: its error names the argument; the chunk
    # finished before it stays in the checkpoint
    folder = tempfile.mkdtemp()
    def bad_fn(m0_scale):
        return nqfjax.solve_lv(lv, m0_scale * jnp.ones(3), ts).loss
    bad = {"m0_scale": np.array([1e-4, 1e-3, 1e-2, -1.0])}
    try:
        nqfjax.sweep(bad_fn, bad, mesh=mesh, chunk=2, checkpoint=folder,
                     progress=False)
        error = None
    except nqfjax.SweepPointError as e:
        error = {"text": str(e), "chunk": e.chunk, "points": list(e.points)}
    kept = json.load(open(folder + "/manifest.json"))["chunks"]
    print(json.dumps({"engines": out, "error": error, "kept": sorted(kept)}))
    """
)


@pytest.mark.slow  # a long physics check (the slow tier)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_sharded_sweep_of_the_engines_on_2_host_devices(dtype):
    env = _env(XLA_FLAGS="--xla_force_host_platform_device_count=2")
    proc = subprocess.run(
        [sys.executable, "-c", _SHARDED, dtype],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # Each device runs the same XLA CPU kernels on its own points as the plain
    # sweep runs on all of them: equal to round-off (float64), or to a few ulps
    # where the batch split changes a reduction's order (float32: rtol 1e-6),
    # relative to each output's scale (entries of M near 0 have no relative
    # accuracy of their own).
    tight = 1e-12 if dtype == "float64" else 1e-6
    engines = ["train", "solve_lv"]
    if dtype == "float64":
        engines += ["train_adam_quadratic", "solve_lv_batch", "solve_mflow"]
        engines += ["sgd_moments"]
    assert sorted(out["engines"]) == sorted(engines)
    for name, run in out["engines"].items():
        # 6 points in chunks of 4, each chunk split into 2 points per device
        assert sorted(run["devices"]) == [0, 1] and run["shard_size"] == 2, name
        # solve_mflow's Kvaerno5 cannot run inside shard_map (lineax refuses its
        # vectors): it runs as a sharded jit, the others per device
        assert run["per_device"] == (name != "solve_mflow"), name
        # Kvaerno5's Newton iterations stop on a tolerance: a last-bit difference
        # in a partitioned product can change an iteration's count, which moves
        # the result by up to its tolerance (1e-9 measured 6.5e-9; float32 ~1e-5)
        rtol = (
            tight if name != "solve_mflow" else (1e-7 if dtype == "float64" else 1e-4)
        )
        plain = jax.tree.leaves(run["plain"], is_leaf=lambda x: isinstance(x, list))
        sharded = jax.tree.leaves(run["sharded"], is_leaf=lambda x: isinstance(x, list))
        for a, b in zip(plain, sharded):
            a, b = np.asarray(a), np.asarray(b)
            assert a.shape[0] == 6 and np.all(np.isfinite(a)), name
            scale = rtol * np.max(np.abs(a))
            np.testing.assert_allclose(b, a, rtol=rtol, atol=scale, err_msg=name)
        # the init scale changes the outputs (the agreement is not trivial)
        first = np.asarray(plain[0]).reshape(6, -1)
        assert np.max(np.ptp(first, axis=0)) > 1e-3 * np.max(np.abs(first)), name
    # the bad point (m0 < 0, in chunk 1) is named by its argument, chunk 0 is kept
    error = out["error"]
    assert error is not None and error["chunk"] == 1 and error["points"] == [2, 3]
    assert "`m0` must be strictly positive" in error["text"], error["text"]
    assert out["kept"] == ["000000"]


@pytest.mark.slow  # a long physics check (the slow tier)
def test_kill_and_resume(tmp_path):
    ckpt = tmp_path / "ckpt"
    gate = tmp_path / "gate"
    script = os.path.join(HERE, "_sweep_worker.py")
    log1, log2 = tmp_path / "log1", tmp_path / "log2"
    args = [str(ckpt), "", str(tmp_path / "out.npz"), str(gate)]

    # First run: chunks 0 and 1 finish, chunk 2 blocks on the gate; kill it there.
    proc = subprocess.Popen(
        [sys.executable, script, *[str(log1) if a == "" else a for a in args]],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 300

    def listed():  # the finished chunks: written, then entered in the manifest
        try:
            return sorted(json.loads((ckpt / "manifest.json").read_text())["chunks"])
        except (FileNotFoundError, json.JSONDecodeError):
            return []

    while listed() != ["000000", "000001"]:
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline, "worker made no progress"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()
    proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    finished = sorted(p.name for p in ckpt.glob("chunk_*.npz"))
    assert finished == ["chunk_000000.npz", "chunk_000001.npz"]
    evaluated1 = {int(x) for x in log1.read_text().split()}
    assert set(range(8)) <= evaluated1  # chunks 0-1 ran, chunk 2 was in flight

    # Restart with the gate open: it must load chunks 0-1 and evaluate only the rest.
    gate.write_text("open")
    proc = subprocess.run(
        [sys.executable, script, *[str(log2) if a == "" else a for a in args]],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = np.load(tmp_path / "out.npz")
    assert int(resumed["n_loaded"]) == 2 and int(resumed["n_computed"]) == 4
    evaluated2 = [int(x) for x in log2.read_text().split()]
    assert sorted(evaluated2) == list(range(8, 24))  # each remaining point once

    # Uninterrupted reference, in this process, without checkpoint or gate.
    point = _sweep_worker.make_point(None, None, "solve_lv")
    ref = nqfjax.sweep(point, _sweep_worker.GRID, chunk=4, progress=False)
    # Deterministic CPU arithmetic on the same grid: equal to round-off.
    np.testing.assert_allclose(resumed["loss"], ref.outputs["loss"], rtol=1e-12)
    np.testing.assert_allclose(resumed["final"], ref.outputs["final"], rtol=1e-12)
    assert np.ptp(resumed["steps"]) > 5  # the adaptive solves differ by point


# --------------------------------------------------------------------------------
# checkpoint integrity


def _double(x):
    return {"y": 2 * x, "z": x**2}


def _damage(file, how: str, rng) -> None:
    data = bytearray(file.read_bytes())
    if how == "truncate":
        file.write_bytes(bytes(data[: len(data) // 2]))
    elif how == "empty":
        file.write_bytes(b"")
    elif how == "flip":  # one bit of the stored numbers (the end of the first leaf)
        k = bytes(data).index(b"leaf_1") - 40
        data[k] ^= 0x01
        file.write_bytes(bytes(data))
    elif how == "random":
        file.write_bytes(rng.bytes(len(data)))


@pytest.mark.parametrize("how", ["truncate", "empty", "flip", "random"])
def test_damaged_chunk_is_named_and_recomputed(tmp_path, how):
    x = np.arange(6.0)
    first = nqfjax.sweep(
        _double, {"x": x}, checkpoint=tmp_path, chunk=2, progress=False
    )
    assert (first.n_computed, first.n_loaded, first.damaged) == (3, 0, ())
    file = tmp_path / "chunk_000001.npz"
    _damage(file, how, np.random.default_rng(0))
    # a `CheckpointWarning` (a `UserWarning`): `nqfjax sweep` tells it apart by
    # its class, not its text
    with pytest.warns(CheckpointWarning, match=re.escape(str(file))):
        again = nqfjax.sweep(
            _double, {"x": x}, checkpoint=tmp_path, chunk=2, progress=False
        )
    assert issubclass(CheckpointWarning, UserWarning)
    assert (again.n_computed, again.n_loaded) == (1, 2)
    assert again.damaged == (str(file),)
    np.testing.assert_array_equal(again.outputs["y"], 2 * x)
    np.testing.assert_array_equal(again.outputs["z"], x**2)
    # the recomputed chunk was written and entered in the manifest: all load now
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        third = nqfjax.sweep(
            _double, {"x": x}, checkpoint=tmp_path, chunk=2, progress=False
        )
    assert (third.n_computed, third.n_loaded, third.damaged) == (0, 3, ())
    np.testing.assert_array_equal(third.outputs["y"], 2 * x)


def _rehash(folder, i: int, data: bytes) -> None:
    """Write `data` as chunk `i` and enter its true size and hash in the manifest:
    a chunk that passes the hash check, so only parsing can refuse it."""
    (folder / f"chunk_{i:06d}.npz").write_bytes(data)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["chunks"][f"{i:06d}"] = {
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _npz(**arrays) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


@pytest.mark.parametrize(
    "content, why",
    [
        (lambda rng: rng.bytes(300), "cannot be read"),
        # object arrays need pickle, which the loader never allows
        (
            lambda rng: _npz(leaf_0=np.array([{}, 1], object), leaf_1=np.ones(2)),
            "Object arrays",
        ),
        (
            lambda rng: _npz(leaf_0=np.ones(2, np.float32), leaf_1=np.ones(2)),
            "dtype float32",
        ),
        (lambda rng: _npz(leaf_0=np.ones(3), leaf_1=np.ones(3)), "shape (3,)"),
        (lambda rng: _npz(leaf_0=np.ones(2)), "holds arrays"),
    ],
)
def test_chunk_matching_its_hash_is_still_checked(tmp_path, content, why):
    x = np.arange(6.0)
    nqfjax.sweep(_double, {"x": x}, checkpoint=tmp_path, chunk=2, progress=False)
    _rehash(tmp_path, 2, content(np.random.default_rng(1)))
    with pytest.warns(UserWarning, match=re.escape(why)):
        again = nqfjax.sweep(
            _double, {"x": x}, checkpoint=tmp_path, chunk=2, progress=False
        )
    assert (again.n_computed, again.n_loaded) == (1, 2)
    assert again.damaged == (str(tmp_path / "chunk_000002.npz"),)
    np.testing.assert_array_equal(again.outputs["z"], x**2)


def test_foreign_chunks_without_manifest_are_never_loaded(tmp_path):
    # the case: a checkpoint of another grid whose manifest was deleted
    nqfjax.sweep(_double, {"x": np.arange(6.0)}, checkpoint=tmp_path, chunk=2,
                 progress=False)  # fmt: skip
    (tmp_path / "manifest.json").unlink()
    x = np.arange(6.0) + 0.93
    with pytest.warns(UserWarning, match="not listed in") as record:
        result = nqfjax.sweep(
            _double, {"x": x}, checkpoint=tmp_path, chunk=2, progress=False
        )
    named = {str(tmp_path / f"chunk_{i:06d}.npz") for i in range(3)}
    assert named == {m for m in named if any(m in str(w.message) for w in record)}
    assert (result.n_computed, result.n_loaded) == (3, 0)
    np.testing.assert_array_equal(result.outputs["y"], 2 * x)  # none of the old
    # and the folder now belongs to the new grid, whole
    again = nqfjax.sweep(_double, {"x": x}, checkpoint=tmp_path, chunk=2,
                         progress=False)  # fmt: skip
    assert (again.n_computed, again.n_loaded) == (0, 3)
    np.testing.assert_array_equal(again.outputs["z"], x**2)


@pytest.mark.parametrize(
    "manifest, why",
    [
        (b"", "is corrupt"),
        (b"{not json", "is corrupt"),
        (b"\xff\xfe", "is corrupt"),
        (b'{"chunks": {}, "format": 2}', "is corrupt"),
        (b'{"fingerprint": "x", "format": 2}', "is corrupt"),
        (b'{"fingerprint": "x", "format": 2, "chunks": {"000000": {"size": "1"}}}',
         "is corrupt"),
        # format 1: no "format" key, no hashes
        (b'{"fingerprint": "x", "chunk": 2}', "was written by an older nqfjax"),
    ],
)  # fmt: skip
def test_corrupt_manifest_is_refused_naming_it(tmp_path, manifest, why):
    nqfjax.sweep(_double, {"x": np.arange(4.0)}, checkpoint=tmp_path, chunk=2,
                 progress=False)  # fmt: skip
    file = tmp_path / "manifest.json"
    file.write_bytes(manifest)
    with pytest.raises(ValueError, match=re.escape(f"{file} {why}")):
        nqfjax.sweep(_double, {"x": np.arange(4.0)}, checkpoint=tmp_path, chunk=2)
    assert file.read_bytes() == manifest  # left as it was for the user to see


def test_checkpoint_that_is_a_file_is_refused(tmp_path):
    file = tmp_path / "ckpt"
    file.write_text("x")
    with pytest.raises(ValueError, match="is not a folder"):
        nqfjax.sweep(_double, {"x": np.arange(4.0)}, checkpoint=file)


# --------------------------------------------------------------------------------
# the compiled program is kept across calls


def test_second_call_compiles_nothing():
    compiled = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(duration)

    @eqx.debug.assert_max_traces(max_traces=1)
    def fn(x, k):
        return {"y": jnp.sin(x) * k}

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        x, k = np.linspace(0.0, 1.0, 6), np.arange(6)
        first = nqfjax.sweep(fn, {"x": x, "k": k}, chunk=3, progress=False)
        assert compiled  # the first call compiled the chunk program ...
        n_compiled = len(compiled)
        # ... a second call with the same function and shapes, other values,
        # traces nothing (assert_max_traces) and compiles nothing
        second = nqfjax.sweep(fn, {"x": x + 1, "k": k[::-1]}, chunk=3, progress=False)
        assert len(compiled) == n_compiled
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    # float64 sin on the same values: equal to numpy's within a few ulp
    np.testing.assert_allclose(first.outputs["y"], np.sin(x) * k, rtol=1e-15)
    np.testing.assert_allclose(second.outputs["y"], np.sin(x + 1) * k[::-1], rtol=1e-15)
    # other shapes (chunks of 2) are another program: fn is traced again
    with pytest.raises(RuntimeError, match="traced"):
        nqfjax.sweep(fn, {"x": x, "k": k}, chunk=2, progress=False)


# --------------------------------------------------------------------------------
# SIGINT held back to safe points (the subprocess test is in test_cli.py)


def _sigint():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)  # the handler runs at the next bytecode of the main thread


def test_defer_interrupts_holds_sigint_to_safe_points():
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run in the main thread only")
    from nqfjax.sweep import defer_interrupts

    previous = signal.getsignal(signal.SIGINT)
    reached = False
    with pytest.raises(KeyboardInterrupt):
        with defer_interrupts() as interrupted:
            assert not interrupted()
            _sigint()
            assert interrupted()  # recorded, not raised
            with defer_interrupts() as inner:  # nested: the same record, and
                assert inner()  # leaving it raises nothing
            reached = True
    assert reached  # ... the outer block raised on leaving
    assert signal.getsignal(signal.SIGINT) is previous
    # a second SIGINT raises at once; the handler is restored after an exception
    with pytest.raises(KeyboardInterrupt):
        with defer_interrupts() as interrupted:
            _sigint()
            assert interrupted()
            _sigint()
            raise AssertionError("not reached")  # pragma: no cover
    assert signal.getsignal(signal.SIGINT) is previous
