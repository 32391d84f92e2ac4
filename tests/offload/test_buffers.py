import random
import re
import threading
import time
from pathlib import Path

import pytest
import torch

from offload.buffers import BufferPool
from offload.host_memory import HUGE_PAGE

KIB = 1024
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_page_bytes(address: int) -> int:
    """Bytes of the mapping holding ``address`` that the kernel backs with huge pages."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            inside = int(span[1], 16) <= address < int(span[2], 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * KIB
    raise AssertionError(f"no mapping holds address {address:#x}")


def test_buffer_is_aligned_and_views_share_memory():
    pool = BufferPool(64 * KIB)
    buf = pool.acquire(10_000)
    assert buf.nbytes == 10_000
    floats = buf.view(torch.float32, 2_500)
    assert floats.data_ptr() % 4096 == 0
    floats.copy_(torch.arange(2_500, dtype=torch.float32))
    # A second view at an offset sees the same bytes: no copy was made.
    tail = buf.view(torch.float32, 10, offset_bytes=4 * 100)
    assert torch.equal(tail, torch.arange(100, 110, dtype=torch.float32))
    as_int = buf.view(torch.int32, 1, offset_bytes=4 * 7)
    assert as_int.item() == torch.tensor([7.0]).view(torch.int32).item()


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here")
@pytest.mark.parametrize("huge_pages", [True, False])
def test_large_buffers_are_in_huge_pages_unless_asked_not_to(huge_pages):
    # O_DIRECT pins a chunk's pages for each transfer: 2 MiB pages make that several times cheaper.
    with BufferPool(8 * HUGE_PAGE, huge_pages=huge_pages).acquire(8 * HUGE_PAGE) as buf:
        memory = buf.view(torch.uint8, buf.nbytes)
        memory.fill_(1)  # the pages are made when first written
        huge = huge_page_bytes(memory.data_ptr())
    assert huge >= 4 * HUGE_PAGE if huge_pages else huge == 0


def test_alignment_larger_than_a_page():
    pool = BufferPool(1 << 20, alignment=64 * KIB)
    buf = pool.acquire(100)
    assert buf.view(torch.uint8, 100).data_ptr() % (64 * KIB) == 0
    assert pool.in_use_bytes == 64 * KIB


def test_view_rejects_out_of_range_and_misaligned_offsets():
    pool = BufferPool(64 * KIB)
    buf = pool.acquire(100)
    with pytest.raises(ValueError, match="past this 100-byte buffer"):
        buf.view(torch.float32, 26)
    with pytest.raises(ValueError, match="not a multiple"):
        buf.view(torch.float32, 2, offset_bytes=2)
    assert buf.view(torch.float32, 25).numel() == 25


def test_request_larger_than_budget_names_sizes():
    pool = BufferPool(8 * KIB)
    with pytest.raises(ValueError, match=r"9000 bytes.*12288.*8192.*raise the buffer budget"):
        pool.acquire(9_000)


def test_pin_true_without_accelerator_is_refused():
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is present, so pinning is allowed")
    with pytest.raises(ValueError, match="pin=True needs an accelerator"):
        BufferPool(8 * KIB, pin=True)
    assert BufferPool(8 * KIB).pin is False


def test_released_memory_is_reused_best_fit():
    pool = BufferPool(256 * KIB)
    small, large = pool.acquire(8 * KIB), pool.acquire(64 * KIB)
    small_ptr = small.view(torch.uint8, 1).data_ptr()
    large_ptr = large.view(torch.uint8, 1).data_ptr()
    pool.release(small)
    pool.release(large)
    assert pool.in_use_bytes == 0 and pool.allocated_bytes == 72 * KIB

    # 5 KiB fits both cached buffers: the smaller one is chosen.
    again = pool.acquire(5 * KIB)
    assert again.view(torch.uint8, 1).data_ptr() == small_ptr
    assert again.nbytes == 5 * KIB
    # The accounting charges the whole buffer that was handed out.
    assert pool.in_use_bytes == 8 * KIB
    bigger = pool.acquire(60 * KIB)
    assert bigger.view(torch.uint8, 1).data_ptr() == large_ptr
    assert pool.allocated_bytes == 72 * KIB


def test_a_spare_buffer_is_a_free_one_or_any_while_none_is_in_use():
    pool = BufferPool(256 * KIB)
    first = pool.acquire_spare(8 * KIB)  # nothing in use: made, as ``acquire`` would
    assert first is not None and pool.allocated_bytes == 8 * KIB
    first_ptr = first.view(torch.uint8, 1).data_ptr()
    # One in use and none free: no new memory, though the budget has room for it.
    assert pool.acquire_spare(8 * KIB) is None and pool.allocated_bytes == 8 * KIB
    held = pool.acquire(64 * KIB)
    pool.release(first)
    again = pool.acquire_spare(4 * KIB)  # the free one, while another is in use
    assert again is not None and again.view(torch.uint8, 1).data_ptr() == first_ptr
    assert pool.allocated_bytes == 72 * KIB
    assert pool.acquire_spare(16 * KIB) is None  # none free holds it
    pool.release(again)
    pool.release(held)


def test_cached_buffers_are_freed_to_stay_within_budget():
    pool = BufferPool(16 * KIB)
    pool.release(pool.acquire(8 * KIB))
    assert pool.allocated_bytes == 8 * KIB
    # No cached buffer holds 12 KiB, and 8 + 12 > 16: the cached one must go first.
    buf = pool.acquire(12 * KIB)
    assert pool.allocated_bytes == 12 * KIB
    assert pool.in_use_bytes == 12 * KIB
    pool.release(buf)


def test_stale_lease_cannot_be_used_or_released_twice():
    pool = BufferPool(16 * KIB)
    buf = pool.acquire(KIB)
    pool.release(buf)
    with pytest.raises(RuntimeError, match="released"):
        buf.view(torch.uint8, 1)
    with pytest.raises(RuntimeError, match="released"):
        pool.release(buf)
    other = BufferPool(16 * KIB)
    with pytest.raises(ValueError, match="another BufferPool"):
        other.release(pool.acquire(KIB))


def test_context_manager_releases():
    pool = BufferPool(16 * KIB)
    with pool.acquire(KIB) as buf:
        assert pool.in_use_bytes == 4 * KIB
        buf.view(torch.uint8, KIB).fill_(1)
    assert pool.in_use_bytes == 0


def test_acquire_times_out_when_budget_is_used():
    pool = BufferPool(8 * KIB)
    held = pool.acquire(8 * KIB)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="8192 of 8192 budget bytes are in use"):
        pool.acquire(KIB, timeout=0.05)
    assert time.monotonic() - start >= 0.04
    with pytest.raises(TimeoutError):
        pool.acquire(KIB, timeout=0)
    pool.release(held)
    assert pool.acquire(KIB, timeout=0).nbytes == KIB


def test_release_wakes_a_blocked_acquire():
    pool = BufferPool(8 * KIB)
    held = pool.acquire(8 * KIB)
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(4 * KIB, timeout=5)))
    waiter.start()
    time.sleep(0.05)
    assert not got  # still blocked: the budget is taken
    pool.release(held)
    waiter.join(timeout=5)
    assert len(got) == 1 and got[0].nbytes == 4 * KIB


def test_many_threads_never_pass_the_budget():
    budget = 64 * KIB
    pool = BufferPool(budget)
    observed_allocated = []
    errors = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(200):
                buf = pool.acquire(rng.randrange(1, 24 * KIB), timeout=10)
                observed_allocated.append(pool.allocated_bytes)
                buf.view(torch.uint8, 1).fill_(seed)
                pool.release(buf)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert max(observed_allocated) <= budget
    assert 0 < pool.peak_bytes <= budget
    assert pool.in_use_bytes == 0
    assert pool.allocated_bytes <= budget


def test_peak_is_the_high_water_mark():
    pool = BufferPool(64 * KIB)
    a = pool.acquire(4 * KIB)
    b = pool.acquire(8 * KIB)
    pool.release(a)
    pool.release(b)
    pool.release(pool.acquire(4 * KIB))
    assert pool.peak_bytes == 12 * KIB
    assert pool.in_use_bytes == 0
