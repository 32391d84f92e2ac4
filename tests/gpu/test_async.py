"""What makes the engine asynchronous on CUDA, each in a way a synchronous engine would fail.

- ``Device.copy`` queues a copy behind the compute stream's work and returns at once: with the
  compute stream busy in ``torch.cuda._sleep``, the call and ``wait_for`` return in a fraction
  of the sleep, the event is not done yet, and after it the bytes are right. A blocking copy
  or a blocking ``wait_for`` would take the whole sleep.
- A training step does not stall the host once per unit: the host waits on the step's path
  (``tests.gpu.host_waits``: the training thread, and autograd's in backward) per step are as
  many for a model of 2 blocks as for one of 8.
- Host-to-device copies cross PCIe in the compute dtype: their source already has the
  destination's dtype. A copy that casts (an fp32 master into a bf16 parameter) moves twice
  the bytes and, being ``non_blocking``, makes an fp32 temporary on the device first.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from engine.config import Config
from engine.engine import Engine
from engine.run.models.gpt import GPT, GPTConfig
from engine.runtime.detect import detect_device
from engine.runtime.device import Device
from tests.gpu import needs_cuda
from tests.gpu.host_waits import PATCHED, HostWaits
from tests.training import SEQ_LEN, batches, config

pytestmark = [pytest.mark.gpu, needs_cuda]

SLEEP_S = 0.1
"""How long the compute stream is kept busy before a copy is queued behind it."""
PROMPT_S = SLEEP_S / 5
"""The most a call that only queues work may take: a launch takes microseconds, so a fifth of
the sleep leaves room for a slow host, while a call that waited for the sleep takes all of it."""
NUMEL = 1 << 20
"""Elements copied (4 MiB of fp32): its copy takes well under a millisecond, far below the sleep."""


@pytest.fixture(scope="module")
def sleep_cycles() -> int:
    """``torch.cuda._sleep``'s cycles for ``SLEEP_S`` on this GPU, from a timed sleep of 20M cycles
    after an untimed one (which loads the kernel and lets the clock rise from idle)."""
    probe = 20_000_000
    torch.cuda._sleep(probe)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return int(probe * SLEEP_S * 1000 / start.elapsed_time(end))  # elapsed_time is in ms


def pinned_device() -> Device:
    """The engine's device with a pinned pool for one buffer of ``NUMEL`` fp32."""
    device = detect_device()
    device.bound_pinned(NUMEL * 4)
    return device


@pytest.mark.parametrize("to_device", [True, False], ids=["host-to-device", "device-to-host"])
def test_a_copy_queues_behind_the_compute_stream_without_holding_the_host(sleep_cycles: int, to_device: bool) -> None:
    device = pinned_device()
    host = device.empty_host(NUMEL, torch.float32, "the copied buffer")
    assert host.is_pinned(), "Device.empty_host cuts from the pinned pool on CUDA"
    on_device = torch.empty(NUMEL, dtype=torch.float32, device=device.device)
    expected = torch.arange(NUMEL, dtype=torch.float32)
    src, dst = (host, on_device) if to_device else (on_device, host)
    src.copy_(expected)
    device.copy(dst, src).synchronize()  # an untimed copy first: the copy stream is made once
    dst.zero_()
    torch.cuda.synchronize()

    torch.cuda._sleep(sleep_cycles)  # on the compute stream
    queued = time.perf_counter()
    event = device.copy(dst, src)
    queued_s = time.perf_counter() - queued
    pending = not event.query()
    waited = time.perf_counter()
    device.wait_for(event)
    waited_s = time.perf_counter() - waited
    event.synchronize()
    done_s = time.perf_counter() - queued

    assert queued_s < PROMPT_S, (
        f"Device.copy held the host {queued_s * 1e3:.1f} ms behind a {SLEEP_S * 1e3:.0f} ms sleep"
    )
    assert pending, "the copy's event was done while the compute stream still slept: it did not queue behind it"
    assert waited_s < PROMPT_S, f"Device.wait_for held the host {waited_s * 1e3:.1f} ms: it must only queue a wait"
    # A quarter: the sleep counts cycles, and the clock may run faster than when it was calibrated.
    assert done_s > SLEEP_S / 4, f"the copy was done {done_s * 1e3:.1f} ms after a {SLEEP_S * 1e3:.0f} ms sleep"
    assert torch.equal(dst.cpu(), expected), "the copy's bytes after its event"


def model(blocks: int) -> GPT:
    """The tiny GPT with ``blocks`` blocks: a unit each, and the root unit."""
    return GPT(GPTConfig.preset("tiny", seq_len=SEQ_LEN, n_layer=blocks), seed=0)


@contextmanager
def stepping(cfg: Config, blocks: int, steps: int) -> Iterator[Callable[[], None]]:
    """One optimizer step of an engine over ``model(blocks)`` per call, for ``steps`` calls at most."""
    eng = Engine(model(blocks), cfg, total_steps=steps)
    data = batches(4)

    def step() -> None:
        eng.backward(eng(*data.next()))
        eng.step()

    try:
        yield step
    finally:
        eng.close()


WARMUP, COUNTED = 1, 2
"""Steps before the count (the first makes the streams, the buffers and the predicted order)
and counted steps."""
PLANS = [(1, "cpu", "device"), (2, "nvme", "device"), (3, "nvme", "cpu")]
"""(stage, offload.optimizer, offload.param): the optimizer state on the host worker, on disk
with the gradients spilled, and the parameter shards in host memory as well."""


def waits_per_step(cfg: Config, blocks: int) -> HostWaits:
    """The host waits of ``COUNTED`` steps after ``WARMUP`` of ``model(blocks)``."""
    waits = HostWaits()
    with stepping(cfg, blocks, WARMUP + COUNTED) as step:
        for _ in range(WARMUP):
            step()
        torch.cuda.synchronize()
        with waits.counting():
            for _ in range(COUNTED):
                step()
    return waits


@pytest.mark.parametrize(("stage", "optimizer", "param"), PLANS)
def test_a_step_stalls_the_host_no_more_for_more_units(stage: int, optimizer: str, param: str, tmp_path: Path) -> None:
    waits = {}
    for blocks in (2, 8):
        offload = {"optimizer": optimizer, "param": param, "nvme_path": str(tmp_path / f"store-{blocks}")}
        cfg = config(zero={"stage": stage}, offload=offload, optim={"grad_clip": 1.0})
        waits[blocks] = waits_per_step(cfg, blocks)
    counts = {blocks: w.training.total() for blocks, w in waits.items()}
    described = "; ".join(f"{blocks} blocks: {w.describe()}" for blocks, w in waits.items())
    assert counts[2] == counts[8], f"host waits in {COUNTED} steps grow with the units: {described}"


def test_the_counter_sees_every_kind_of_host_wait() -> None:
    device = detect_device()
    on_device = torch.ones(4, device=device.device)
    event = device.copy(torch.empty(4, pin_memory=True), on_device)
    assert isinstance(event, torch.cuda.Event), f"Device.copy returns {type(event)}: count its synchronize too"
    with HostWaits().counting() as waits:
        event.synchronize()
        torch.cuda.current_stream().synchronize()
        torch.cuda.synchronize()
        torch.accelerator.synchronize()
        for read in (torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, float, int, bool):
            read(on_device[:1])
        torch.ones(1).item()  # on the host: no wait
    assert waits.training == dict.fromkeys(PATCHED, 1), waits.describe()
    assert not waits.helpers


@dataclass(frozen=True)
class Copy:
    """One ``Device.copy``: its tensors' dtypes, its direction and its bytes."""

    src: torch.dtype
    dst: torch.dtype
    to_device: bool
    nbytes: int


def recorded_copies(cfg: Config, steps: int, patch: pytest.MonkeyPatch) -> list[Copy]:
    """Every ``Device.copy`` of ``steps`` steps of the tiny GPT under ``cfg`` (its building included)."""
    copies: list[Copy] = []
    copy = Device.copy

    def recording(self: Device, dst: torch.Tensor, src: torch.Tensor, **direction: bool):
        copies.append(Copy(src.dtype, dst.dtype, dst.is_cuda and not src.is_cuda, src.nbytes))
        return copy(self, dst, src, **direction)

    patch.setattr(Device, "copy", recording)
    with stepping(cfg, 4, steps) as step:
        for _ in range(steps):
            step()
    return copies


@pytest.mark.parametrize(
    ("stage", "optimizer", "param"), [(1, "cpu", "device"), (3, "cpu", "device"), (3, "nvme", "cpu")]
)
def test_host_to_device_copies_carry_the_compute_dtype(
    stage: int, optimizer: str, param: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    offload = {"optimizer": optimizer, "param": param, "nvme_path": str(tmp_path / "store")}
    cfg = config(zero={"stage": stage}, offload=offload, precision={"compute_dtype": "bf16"})
    copies = recorded_copies(cfg, 2, monkeypatch)
    to_device = [c for c in copies if c.to_device]
    assert to_device, "the step copies new parameters to the device"
    casting = sorted({(str(c.src), str(c.dst)) for c in to_device if c.src != c.dst})
    cast_mib = sum(c.nbytes for c in to_device if c.src != c.dst) / 2**20
    assert not casting, f"host-to-device copies cast {casting}: {cast_mib:.2f} MiB sent wider than the compute dtype"
