"""Pinned host memory at its exact size: what is registered with CUDA is what was asked
(rounded up to the page, never to a power of two as torch's pinned allocator rounds), and the
registration ends when the last view of the memory goes."""

from __future__ import annotations

import gc

import torch

from offload.buffers import BufferPool
from offload.host_memory import PAGE, host_bytes
from tests.pins import DEVICE, record_pins

MIB = 1 << 20


def test_pinned_memory_is_registered_at_its_size_until_its_last_view_goes(monkeypatch) -> None:
    calls = record_pins(monkeypatch)
    memory = host_bytes(3 * MIB + 100, pin_on=DEVICE)
    assert memory.numel() == 3 * MIB + 100 and memory.data_ptr() % PAGE == 0
    assert calls == [("register", memory.data_ptr(), 3 * MIB + PAGE)], "rounded to the page, not to 4 MiB"
    address, view = memory.data_ptr(), memory[PAGE:].view(torch.float32)
    del memory
    gc.collect()
    assert len(calls) == 1, "a view still uses it: it stays registered"
    view.fill_(1.0)
    del view
    gc.collect()
    assert calls[1:] == [("unregister", address, DEVICE)]


def test_unpinned_memory_is_never_registered(monkeypatch) -> None:
    calls = record_pins(monkeypatch)
    memory = host_bytes(PAGE + 1)
    memory.fill_(7)
    del memory
    gc.collect()
    assert calls == []


def test_a_pinned_buffer_pool_pins_each_buffer_at_its_size(monkeypatch) -> None:
    calls = record_pins(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    pool = BufferPool(8 * MIB, pin=True)
    buf = pool.acquire(4 * MIB)
    memory = buf.view(torch.uint8, buf.nbytes)
    assert memory.data_ptr() % PAGE == 0
    assert calls == [("register", memory.data_ptr(), 4 * MIB)], "a power of two pins itself, not twice its size"
    pool.release(buf)
    del buf, memory
    pool.release(pool.acquire(6 * MIB))  # the cached 4 MiB block is freed to stay within the budget
    gc.collect()
    assert calls[1:] == [("unregister", calls[0][1], DEVICE), ("register", calls[2][1], 6 * MIB)], (
        "unpinned before the next is pinned: the budget bounds what is pinned"
    )
