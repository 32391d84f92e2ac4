import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from offload.buffers import BufferPool, HostBuffer
from offload.io import IORunner, OffloadIOError
from offload.pipeline import Pipeline

KIB = 1024


class ThreadRunner:
    """A plain thread pool behind the runner interface; records what was submitted, in order."""

    def __init__(self, threads: int = 2) -> None:
        self._pool = ThreadPoolExecutor(threads)
        self.submitted: list[str] = []

    def coordinate(self, fn, *args, what: str) -> Future:
        self.submitted.append(what)
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        self._pool.shutdown()


class InlineRunner:
    """Runs each task at once in the caller, so failures are settled before submit returns."""

    def coordinate(self, fn, *args, what: str) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args))
        except Exception as exc:
            future.set_exception(exc)
        return future


@pytest.fixture
def runner():
    runner = ThreadRunner()
    yield runner
    runner.close()


@pytest.fixture(params=["threads", "io"])
def any_runner(request):
    runner = ThreadRunner() if request.param == "threads" else IORunner(threads=2, queue_depth=4)
    yield runner
    runner.close()


def fill(item: int, buf: HostBuffer) -> None:
    buf.view(torch.uint8, buf.nbytes).fill_(item % 251)


def issued_items(runner: ThreadRunner) -> list[int]:
    return [int(m.group(1)) for what in runner.submitted if (m := re.search(r"load item(\d+)", what))]


def test_items_arrive_in_order_with_their_data(any_runner):
    sizes = [3 * KIB, 10 * KIB, 1, 7 * KIB, 4 * KIB, 12 * KIB, 2 * KIB]
    pool = BufferPool(128 * KIB)
    pipe = Pipeline(pool, any_runner, window_bytes=16 * KIB)
    saved = {}

    def save(item: int, buf: HostBuffer) -> None:
        saved[item] = buf.view(torch.uint8, buf.nbytes).clone()

    received = []
    for item, buf in pipe.read_ahead(range(len(sizes)), nbytes=lambda i: sizes[i], load=fill):
        assert buf.nbytes == sizes[item]
        assert torch.all(buf.view(torch.uint8, buf.nbytes) == item)
        received.append(item)
        pipe.write_back(item, buf, save)
    stats = pipe.drain()

    assert received == list(range(len(sizes)))
    assert sorted(saved) == received
    assert all(torch.all(saved[i] == i) and saved[i].numel() == sizes[i] for i in received)
    assert stats.bytes_read == sum(sizes)
    assert stats.bytes_written == sum(sizes)
    assert pool.in_use_bytes == 0


@pytest.mark.parametrize(
    "sizes, window",
    [
        ([4 * KIB] * 10, 12 * KIB),  # exactly three items fit
        ([6 * KIB, 3 * KIB, 3 * KIB, 6 * KIB, 1 * KIB, 2 * KIB, 8 * KIB, 4 * KIB, 9 * KIB], 10 * KIB),
    ],
)
def test_prefetch_fills_the_window_and_never_passes_it(runner, sizes, window):
    pool = BufferPool(256 * KIB)
    pipe = Pipeline(pool, runner, window_bytes=window)
    ahead_bytes = []
    ahead_counts = []
    items = pipe.read_ahead(range(len(sizes)), nbytes=lambda i: sizes[i], load=fill, describe=lambda i: f"item{i}")
    for item, buf in items:
        # Loads are issued by the iterator itself, so what was issued is fixed until we ask for more.
        ahead = [i for i in issued_items(runner) if i > item]
        assert ahead == list(range(item + 1, item + 1 + len(ahead)))  # in order, none skipped
        ahead_bytes.append(sum(sizes[i] for i in ahead))
        ahead_counts.append(len(ahead))
        # Not stopping short: the next item would not have fit (or none is left).
        if item + 1 + len(ahead) < len(sizes):
            assert ahead_bytes[-1] + sizes[item + 1 + len(ahead)] > window
        pipe.release(buf)
    pipe.drain()
    assert max(ahead_bytes) <= window
    assert max(ahead_counts) > 1
    assert pool.in_use_bytes == 0


def test_an_item_larger_than_the_window_still_loads(runner):
    pool = BufferPool(64 * KIB)
    pipe = Pipeline(pool, runner, window_bytes=KIB)
    got = []
    for item, buf in pipe.read_ahead([0, 1, 2], nbytes=lambda i: 8 * KIB, load=fill):
        got.append(item)
        pipe.release(buf)
    assert got == [0, 1, 2]
    assert pipe.drain().bytes_read == 24 * KIB


def test_load_error_surfaces_at_its_item_and_frees_buffers(any_runner):
    pool = BufferPool(64 * KIB)
    pipe = Pipeline(pool, any_runner, window_bytes=16 * KIB)

    def load(item: int, buf: HostBuffer) -> None:
        if item == 3:
            raise OSError(5, "Input/output error", "shard-3.bin")
        fill(item, buf)

    received = []
    with pytest.raises(OSError, match="Input/output error") as excinfo:
        for item, buf in pipe.read_ahead(range(8), nbytes=lambda i: 4 * KIB, load=load, describe=lambda i: f"item{i}"):
            received.append(item)
            pipe.release(buf)
    assert received == [0, 1, 2]
    if isinstance(any_runner, IORunner):
        assert isinstance(excinfo.value, OffloadIOError)
        assert "load item3" in str(excinfo.value)
    assert pool.in_use_bytes == 0


def test_save_error_surfaces_in_drain_after_all_settle(runner):
    pool = BufferPool(64 * KIB)
    pipe = Pipeline(pool, runner, window_bytes=16 * KIB)
    finished = []

    def save(item: int, buf: HostBuffer) -> None:
        time.sleep(0.01 * (item % 2))
        if item in (2, 4):
            raise OSError(28, f"No space left on device writing item {item}")
        finished.append(item)

    for item, buf in pipe.read_ahead(range(6), nbytes=lambda i: 2 * KIB, load=fill):
        pipe.write_back(item, buf, save)
    with pytest.raises(OSError, match="No space left") as excinfo:
        pipe.drain()
    assert sorted(finished) == [0, 1, 3, 5]  # the failure waited for every other write
    assert any("1 more write-back" in note for note in excinfo.value.__notes__)
    assert pool.in_use_bytes == 0
    assert pipe.drain().bytes_written == 0  # the failure ended the run; a new one starts clean


def test_save_error_surfaces_at_the_next_write_back():
    pool = BufferPool(64 * KIB)
    pipe = Pipeline(pool, InlineRunner(), window_bytes=16 * KIB)

    def save(item: int, buf: HostBuffer) -> None:
        if item == 0:
            raise OSError(5, "Input/output error")

    with pytest.raises(OSError, match="Input/output error"):
        for item, buf in pipe.read_ahead(range(4), nbytes=lambda i: 2 * KIB, load=fill):
            pipe.write_back(item, buf, save)
    assert pool.in_use_bytes == 0


def test_abandoning_the_stream_leaks_nothing(runner):
    pool = BufferPool(64 * KIB)
    pipe = Pipeline(pool, runner, window_bytes=32 * KIB)
    loaded = []

    def slow_load(item: int, buf: HostBuffer) -> None:
        time.sleep(0.02)
        loaded.append(item)

    for item, buf in pipe.read_ahead(range(20), nbytes=lambda i: 4 * KIB, load=slow_load):
        pipe.release(buf)
        if item == 1:
            break
    assert pool.in_use_bytes == 0
    assert len(loaded) < 20  # loads not yet started were cancelled

    with pytest.raises(RuntimeError, match="consumer failed"):
        for _item, buf in pipe.read_ahead(range(20), nbytes=lambda i: 4 * KIB, load=slow_load):
            pipe.release(buf)
            raise RuntimeError("consumer failed")
    assert pool.in_use_bytes == 0

    stream = pipe.read_ahead(range(20), nbytes=lambda i: 4 * KIB, load=slow_load)
    item, buf = next(stream)
    pipe.release(buf)
    stream.close()
    assert pool.in_use_bytes == 0


def test_stats_count_bytes_and_reset(runner):
    pool = BufferPool(64 * KIB)
    pipe = Pipeline(pool, runner, window_bytes=8 * KIB)
    sizes = [1000, 2000, 3000, 4000]

    def save(item: int, buf: HostBuffer) -> None:
        time.sleep(0.01)

    for item, buf in pipe.read_ahead(range(4), nbytes=lambda i: sizes[i], load=fill):
        if item % 2:
            pipe.write_back(item, buf, save)
        else:
            pipe.release(buf)
    stats = pipe.drain()
    assert stats.bytes_read == sum(sizes)
    assert stats.bytes_written == sizes[1] + sizes[3]
    assert stats.io_busy_s >= 0.02
    assert stats.hidden_s == pytest.approx(max(0.0, stats.io_busy_s - stats.read_wait_s - stats.write_wait_s))
    again = pipe.drain()
    assert (again.bytes_read, again.bytes_written, again.io_busy_s) == (0, 0, 0.0)


def test_pending_write_backs_are_bounded_by_the_window():
    runner = ThreadRunner(threads=4)
    pool = BufferPool(256 * KIB)
    pipe = Pipeline(pool, runner, window_bytes=8 * KIB)
    lock = threading.Lock()
    running = [0]
    most = [0]

    def save(item: int, buf: HostBuffer) -> None:
        with lock:
            running[0] += buf.nbytes
            most[0] = max(most[0], running[0])
        time.sleep(0.02)
        with lock:
            running[0] -= buf.nbytes

    try:
        for item, buf in pipe.read_ahead(range(8), nbytes=lambda i: 4 * KIB, load=fill):
            pipe.write_back(item, buf, save)
        stats = pipe.drain()
    finally:
        runner.close()
    assert most[0] == 8 * KIB  # two at a time: the window, with threads to spare
    assert stats.write_wait_s > 0.02


def test_a_pool_smaller_than_the_window_does_not_deadlock(runner):
    pool = BufferPool(8 * KIB)
    pipe = Pipeline(pool, runner, window_bytes=64 * KIB)

    def save(item: int, buf: HostBuffer) -> None:
        time.sleep(0.005)

    got = []
    for item, buf in pipe.read_ahead(range(10), nbytes=lambda i: 4 * KIB, load=fill):
        got.append(item)
        pipe.write_back(item, buf, save)
    pipe.drain()
    assert got == list(range(10))
    assert pool.peak_bytes <= 8 * KIB


def test_loads_overlap_with_compute(any_runner):
    pool = BufferPool(64 * KIB)
    pipe = Pipeline(pool, any_runner, window_bytes=8 * KIB)
    delay, count = 0.05, 6

    def slow_load(item: int, buf: HostBuffer) -> None:
        time.sleep(delay)

    start = time.perf_counter()
    for _item, buf in pipe.read_ahead(range(count), nbytes=lambda i: 4 * KIB, load=slow_load):
        time.sleep(delay)  # compute
        pipe.release(buf)
    elapsed = time.perf_counter() - start
    stats = pipe.drain()
    serial = 2 * delay * count
    assert elapsed < 0.8 * serial
    assert stats.hidden_s > 0.5 * delay * (count - 1)


def test_a_load_the_pool_had_no_room_for_starts_as_soon_as_a_write_back_frees_it():
    """The consumer holds item 0 and writes it back while item 1 is still loading, and the pool
    has no room for item 2: once 0's write lands, 2's load starts at once, while the consumer
    still waits for 1 (not when 1 is handed over), so the disk reads while it writes."""
    runner = ThreadRunner(threads=4)
    pipe = Pipeline(BufferPool(8 * KIB), runner, window_bytes=8 * KIB)
    save_may_end, load_1_may_end, load_2_started = threading.Event(), threading.Event(), threading.Event()

    def load(item: int, buf: HostBuffer) -> None:
        if item == 1:
            assert load_1_may_end.wait(10)
        if item == 2:
            load_2_started.set()

    def save(item: int, buf: HostBuffer) -> None:
        assert save_may_end.wait(10)

    got = []

    def consume() -> None:
        for item, buf in pipe.read_ahead(range(3), nbytes=lambda i: 4 * KIB, load=load):
            got.append(item)
            pipe.write_back(item, buf, save)
            save_may_end.set()  # item 0's write lands while the consumer waits for item 1
        pipe.drain()

    consumer = threading.Thread(target=consume)
    try:
        consumer.start()
        started_early = load_2_started.wait(5)
    finally:
        load_1_may_end.set()
        consumer.join(10)
        runner.close()
    assert started_early, "item 2's load waited for item 1 to be handed over"
    assert got == [0, 1, 2]


def test_window_must_be_positive(runner):
    with pytest.raises(ValueError, match="window_bytes must be positive"):
        Pipeline(BufferPool(KIB), runner, window_bytes=0)
