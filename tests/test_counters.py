"""Global counters: FileGlobalCounter (flock) and StoreGlobalCounter (torch.distributed TCPStore).

Real ``spawn`` processes hammer the counters concurrently; every update's return value is
collected so atomicity is checked exactly (all values distinct and contiguous), not just the total.
torch is only imported inside the store tests (the file-counter workers stay torch-free).
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import threading
import time
from pathlib import Path

import pytest

from pi0.ript.algos.rl_optimizers.file_counter import FileGlobalCounter

pytestmark = pytest.mark.timeout(120)

NUM_PROCS = 8
FILE_INCREMENTS = 1000
STORE_INCREMENTS = 1000
RESET_TO = 1_000_000


def _hammer(counter, n: int, start, results, reset_at: int | None) -> None:
    """Worker: warm up, wait at the barrier, do ``n`` updates (optionally one reset midway), report values."""
    counter.get()  # connect / open the lock file (and import torch for the store) before timing
    start.wait()
    values, reads_ok = [], True
    for i in range(n):
        if reset_at is not None and i == reset_at:
            counter.reset(RESET_TO)
        v = counter.update()
        values.append(v)
        if i % 97 == 0:  # concurrent reads are never behind this process's own last update
            reads_ok &= counter.get() >= v if reset_at is None else True
    results.put((values, reads_ok))


def _run_procs(counter, n: int, reset_proc: int | None = None, num_procs: int = NUM_PROCS) -> tuple[list[int], float]:
    """Run ``num_procs`` spawned workers against ``counter``; returns all returned values and the update time."""
    ctx = mp.get_context("spawn")
    start, results = ctx.Barrier(num_procs + 1), ctx.Queue()
    procs = [ctx.Process(target=_hammer, args=(counter, n, start, results, n // 2 if p == reset_proc else None))
             for p in range(num_procs)]
    for p in procs:
        p.start()
    start.wait(timeout=100)  # every worker is ready: only the updates are timed
    t0 = time.perf_counter()
    out, ok = [], True
    for _ in procs:
        values, reads_ok = results.get(timeout=100)
        out.extend(values)
        ok &= reads_ok
    dt = time.perf_counter() - t0
    for p in procs:
        p.join(60)  # a spawned worker's exit (torch teardown) can take > 10 s on a loaded 2-core machine
        assert p.exitcode == 0
    assert ok
    return out, dt


def _check_reset_split(values: list[int], final: int, num_procs: int = NUM_PROCS) -> None:
    """Values before the reset are exactly 1..m, after it exactly RESET_TO+1..final (linearizable)."""
    below = sorted(v for v in values if v < RESET_TO)
    above = sorted(v for v in values if v > RESET_TO)
    assert len(below) + len(above) == len(values)
    assert below == list(range(1, len(below) + 1))
    assert above == list(range(RESET_TO + 1, RESET_TO + len(above) + 1))
    assert final == RESET_TO + len(above)
    assert len(above) >= len(values) // (2 * num_procs)  # the reset happened mid-run


# ------------------------------------------------------------------------------ file counter
def test_file_counter_basic_and_cleanup(tmp_path: Path):
    path = tmp_path / "sub" / "count"
    with FileGlobalCounter(path) as c:
        assert c.get() == 0
        assert c.update() == 1 and c.update(5) == 6 and c.get() == 6
        c.reset(41)
        assert c.update() == 42
        c2 = pickle.loads(pickle.dumps(c))  # pickles to its path: another handle on the same counter
        assert c2.update(-2) == 40 and c.get() == 40
        assert path.exists() and Path(f"{path}.lock").exists()
    assert not path.exists() and not Path(f"{path}.lock").exists()  # context exit cleans up
    assert not path.parent.exists()  # ... including the directory the counter created
    c.cleanup()  # idempotent


def test_file_counter_cleanup_leaves_nothing_behind(tmp_path: Path):
    fds_before = len(os.listdir("/proc/self/fd"))
    with FileGlobalCounter(tmp_path / "a" / "b" / "count") as c:
        c.update()
        other = FileGlobalCounter(c.path)  # a second handle, dropped without close(): no descriptor leak
        assert other.update() == 2
        del other
        gc.collect()
    assert not (tmp_path / "a").exists()  # files, lock file and the directories the counter created
    assert len(os.listdir("/proc/self/fd")) == fds_before
    keep = tmp_path / "keep"  # a directory that existed (with other files) is left alone
    keep.mkdir()
    (keep / "other").write_text("")
    c = FileGlobalCounter(keep / "count")
    c.update()
    c.cleanup()
    assert sorted(os.listdir(keep)) == ["other"]


def test_file_counter_cleanup_waits_for_a_running_update(tmp_path: Path):
    path = tmp_path / "count"
    a, b = FileGlobalCounter(path), FileGlobalCounter(path)
    a.update()
    with a._locked(exclusive=True):  # another handle is in the middle of an update
        t = threading.Thread(target=b.cleanup)
        t.start()
        t.join(0.3)
        assert t.is_alive() and path.exists()  # cleanup blocks on the exclusive lock
    t.join(10)
    assert not t.is_alive() and not path.exists() and not Path(f"{path}.lock").exists()
    a.close()


def test_file_counter_threads(tmp_path: Path):
    c = FileGlobalCounter(tmp_path / "count")
    out: list[int] = []
    lock = threading.Lock()

    def work():
        vals = [c.update() for _ in range(500)]
        with lock:
            out.extend(vals)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(out) == list(range(1, 4001)) and c.get() == 4000
    c.cleanup()


def test_file_counter_8_processes_x_1000(tmp_path: Path):
    c = FileGlobalCounter(tmp_path / "count")
    values, dt = _run_procs(c, FILE_INCREMENTS)
    print(f"\nfile counter: {NUM_PROCS} procs x {FILE_INCREMENTS} updates in {dt:.2f} s")
    assert c.get() == NUM_PROCS * FILE_INCREMENTS
    assert sorted(values) == list(range(1, NUM_PROCS * FILE_INCREMENTS + 1))  # every update atomic
    c.cleanup()


def test_file_counter_reset_under_concurrency(tmp_path: Path):
    c = FileGlobalCounter(tmp_path / "count")
    values, _ = _run_procs(c, FILE_INCREMENTS, reset_proc=3)
    _check_reset_split(values, c.get())
    c.cleanup()


# ----------------------------------------------------------------------------- store counter
@pytest.fixture()
def tcp_store():
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # port 0: a free port
    yield store


def test_store_counter_basic(tcp_store):
    from pi0.ript.algos.rl_optimizers.store_counter import StoreGlobalCounter

    c = StoreGlobalCounter(tcp_store, "basic")
    assert c.get() == 0 and c.update() == 1 and c.update(4) == 5
    c.reset(10)
    assert c.get() == 10 and c.update() == 11
    remote = StoreGlobalCounter.connect("127.0.0.1", tcp_store.port, "basic")
    assert pickle.loads(pickle.dumps(remote)).update() == 12 and c.get() == 12
    with pytest.raises(TypeError):
        pickle.dumps(c)  # a live store cannot travel; connect() counters can
    with c:
        pass
    assert c.get() == 0  # cleanup deleted the key


def test_store_counter_8_processes(tcp_store):
    from pi0.ript.algos.rl_optimizers.store_counter import StoreGlobalCounter

    c = StoreGlobalCounter.connect("127.0.0.1", tcp_store.port, "hammer")
    t0 = time.perf_counter()
    values, dt = _run_procs(c, STORE_INCREMENTS)
    print(f"\nstore counter: {NUM_PROCS} procs x {STORE_INCREMENTS} updates in {dt:.2f} s "
          f"({time.perf_counter() - t0:.2f} s incl. process start)")
    assert c.get() == NUM_PROCS * STORE_INCREMENTS
    assert sorted(values) == list(range(1, NUM_PROCS * STORE_INCREMENTS + 1))
    c.cleanup()


def test_store_counter_reset_under_concurrency(tcp_store):
    from pi0.ript.algos.rl_optimizers.store_counter import StoreGlobalCounter

    c = StoreGlobalCounter.connect("127.0.0.1", tcp_store.port, "reset")
    values, _ = _run_procs(c, STORE_INCREMENTS, reset_proc=1, num_procs=4)  # 4 procs: each spawn imports torch
    _check_reset_split(values, c.get(), num_procs=4)
    c.cleanup()
