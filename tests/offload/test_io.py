"""Tests for the I/O runner: error wrapping, backpressure, gather, and no deadlock."""

import errno
import threading
import time

import pytest

from offload.io import IORunner, OffloadIOError

TIMEOUT = 10


def _fail_with(err: BaseException) -> None:
    raise err


def test_submit_returns_result():
    with IORunner(threads=2) as runner:
        assert runner.submit(lambda a, b: a + b, 2, 3, what="add").result(TIMEOUT) == 5


def test_os_error_is_wrapped_with_what_errno_and_cause():
    original = OSError(errno.ENOSPC, "No space left on device", "/data/c/0")
    with IORunner(threads=1) as runner:
        future = runner.submit(_fail_with, original, what="write gen-1/blocks.0/master elements [0, 64)")
        with pytest.raises(OffloadIOError) as info:
            future.result(TIMEOUT)
    err = info.value
    assert err.errno == errno.ENOSPC
    assert "write gen-1/blocks.0/master elements [0, 64)" in str(err)
    assert err.filename == "/data/c/0"
    assert err.__cause__ is original


def test_os_error_without_errno_is_wrapped():
    with IORunner(threads=1) as runner:
        future = runner.submit(_fail_with, OSError("odd failure"), what="read x")
        with pytest.raises(OffloadIOError, match="read x: odd failure") as info:
            future.result(TIMEOUT)
    assert info.value.errno is None


def test_other_errors_keep_their_type_and_gain_a_note():
    with IORunner(threads=1) as runner:
        future = runner.submit(_fail_with, ValueError("bad bytes"), what="read y chunk 3")
        with pytest.raises(ValueError, match="bad bytes") as info:
            future.result(TIMEOUT)
    assert not isinstance(info.value, OSError)
    assert any("read y chunk 3" in note for note in info.value.__notes__)


def test_backpressure_bounds_pending_tasks():
    depth = 3
    release = threading.Event()
    with IORunner(threads=1, queue_depth=depth) as runner:
        futures = [runner.submit(release.wait, TIMEOUT, what=f"block {i}") for i in range(depth)]
        submitted = threading.Event()

        def one_more():
            futures.append(runner.submit(release.wait, TIMEOUT, what="one more"))
            submitted.set()

        producer = threading.Thread(target=one_more)
        producer.start()
        # All slots are taken by unfinished tasks: the producer must be held back.
        assert not submitted.wait(0.3)
        release.set()
        assert submitted.wait(TIMEOUT)
        producer.join(TIMEOUT)
        assert all(f.result(TIMEOUT) for f in futures)


def test_pending_never_exceeds_queue_depth():
    depth = 4
    lock = threading.Lock()
    pending = 0
    peak = 0

    def task():
        nonlocal pending
        time.sleep(0.001)
        with lock:
            pending -= 1

    with IORunner(threads=2, queue_depth=depth) as runner:
        for i in range(60):
            with lock:
                pending += 1
                peak = max(peak, pending)
            runner.submit(task, what=f"task {i}")
    # A task counts as pending from just before submit until it finishes; the
    # submit of task k+depth can only pass once some earlier task released its slot.
    assert 1 < peak <= depth + 1


def test_gather_returns_results_in_order():
    with IORunner(threads=3) as runner:

        def late(i):
            time.sleep(0.01 * (5 - i))  # the first submitted finishes last
            return i

        futures = [runner.submit(late, i, what=f"t{i}") for i in range(5)]
        assert IORunner.gather(futures).result(TIMEOUT) == [0, 1, 2, 3, 4]


def test_gather_of_nothing_is_done():
    assert IORunner.gather([]).result(0) == []


def test_gather_propagates_first_error_only_after_all_done():
    release = threading.Event()
    with IORunner(threads=2) as runner:
        failing = runner.submit(_fail_with, OSError(errno.EIO, "Input/output error"), what="read z chunk 0")
        slow = runner.submit(release.wait, TIMEOUT, what="read z chunk 1")
        combined = IORunner.gather([failing, slow])
        failing.exception(TIMEOUT)
        # A task still holds the caller's buffer: the combined future must wait for it.
        time.sleep(0.1)
        assert not combined.done()
        release.set()
        with pytest.raises(OffloadIOError, match="read z chunk 0") as info:
            combined.result(TIMEOUT)
    assert info.value.errno == errno.EIO


def test_no_deadlock_with_one_thread_many_compound_tasks():
    results = []

    def scenario():
        with IORunner(threads=1, queue_depth=2) as runner:

            def parent(i):
                # A compound task waits on its leaf tasks from a coordinating thread, which
                # holds no I/O thread: the one I/O thread is always free to run them.
                children = [runner.submit(lambda j=j: i * 10 + j, what=f"child {i}.{j}") for j in range(3)]
                return sum(IORunner.gather(children).result())

            futures = [runner.coordinate(parent, i, what=f"parent {i}") for i in range(100)]
            results.extend(IORunner.gather(futures).result())

    # In a daemon thread, so that a deadlock fails the test instead of hanging the run.
    worker = threading.Thread(target=scenario, daemon=True)
    worker.start()
    worker.join(TIMEOUT)
    assert not worker.is_alive(), "IORunner deadlocked"
    assert results == [30 * i + 3 for i in range(100)]


def test_a_compound_task_runs_its_leaves_on_every_thread_at_once():
    threads = 4
    arrived = threading.Barrier(threads, timeout=TIMEOUT)  # passes only once all are running together
    with IORunner(threads=threads, queue_depth=threads) as runner:

        def unit():
            leaves = [runner.submit(arrived.wait, what=f"chunk {k}") for k in range(threads)]
            return IORunner.gather(leaves).result()

        assert sorted(runner.coordinate(unit, what="unit").result(TIMEOUT)) == list(range(threads))


def test_tasks_that_could_wait_on_themselves_are_refused():
    with IORunner(threads=1) as runner:
        nested = runner.submit(lambda: runner.submit(print, what="chunk 0"), what="leaf")
        with pytest.raises(RuntimeError, match="cannot start 'chunk 0' from an I/O thread") as info:
            nested.result(TIMEOUT)
        assert "in I/O task: leaf" in info.value.__notes__
        compound = runner.coordinate(lambda: runner.coordinate(print, what="unit b"), what="unit a")
        with pytest.raises(RuntimeError, match="cannot start 'unit b' from a coordinating thread"):
            compound.result(TIMEOUT)


def test_close_then_submit_raises_and_close_is_idempotent():
    runner = IORunner(threads=1)
    runner.close()
    runner.close()
    with pytest.raises(RuntimeError, match="closed"):
        runner.submit(print, what="late")


def test_invalid_sizes_are_refused():
    with pytest.raises(ValueError, match="threads"):
        IORunner(threads=0)
    with pytest.raises(ValueError, match="queue_depth"):
        IORunner(queue_depth=0)


def test_then_runs_the_follow_up_on_a_checking_thread_while_the_io_thread_moves_on():
    with IORunner(threads=1) as runner:
        check_started, release = threading.Event(), threading.Event()

        def check(value: int) -> tuple[int, str]:
            check_started.set()
            assert release.wait(TIMEOUT)
            return value * 10, threading.current_thread().name

        first = runner.then(runner.submit(lambda: 4, what="read 0"), check, what="check 0")
        assert check_started.wait(TIMEOUT)
        # The only I/O thread is free while the check waits: the next read runs at once.
        assert runner.submit(lambda: 5, what="read 1").result(TIMEOUT) == 5
        release.set()
        value, thread = first.result(TIMEOUT)
    assert value == 40 and thread.startswith("offload-check")


def test_then_passes_on_the_task_error_and_names_a_failed_follow_up():
    checked = []
    with IORunner(threads=2) as runner:
        failed = runner.submit(_fail_with, OSError(errno.EIO, "I/O error"), what="read c/0")
        passed_on = runner.then(failed, checked.append, what="check c/0")
        with pytest.raises(OffloadIOError, match="read c/0"):
            passed_on.result(TIMEOUT)
        bad = runner.then(runner.submit(lambda: 1, what="read c/1"), _fail_with_value, what="check c/1")
        with pytest.raises(ValueError, match="bad checksum") as info:
            bad.result(TIMEOUT)
    assert checked == []  # a read that failed is never checked
    assert "in I/O task: check c/1" in info.value.__notes__


def _fail_with_value(_value: object) -> None:
    raise ValueError("bad checksum")
