"""The host kernel of the int8-moment update (``engine.zero.host_update``): bit for bit the
formula of ``compact_update.compact_adamw_`` in fp32, as a NumPy transcription computes it,
on one thread or several; within torch's own rounding of the same function; and where it
cannot be built, the torch kernel runs instead after one warning."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from engine.config import OptimConfig
from engine.runtime import native
from engine.state.quantize import BLOCK, blocks, noise_table, packed_bytes, periodic
from engine.zero import compact_update, host_update
from engine.zero.compact_update import compact_step

CPU = torch.device("cpu")
HYPER = torch.tensor((1e-3, 0.8, 0.95, 1e-8, 0.1, 1 - 0.8**3, (1 - 0.95**3) ** 0.5))
"""lr, betas, eps, weight decay and the third step's bias corrections, away from the defaults."""


def shard(numel: int, master: torch.dtype, grad: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    """Master, gradient and int8 moments as a few steps leave them: codes of every level and
    block scales spread over orders of magnitude."""
    generator = torch.Generator().manual_seed(seed)
    weights = (torch.randn(numel, generator=generator) * 0.02).to(master)
    gradient = (torch.randn(numel, generator=generator) * torch.logspace(-5, -2, numel)).to(grad)
    moments = [torch.randint(0, 256, (packed_bytes(numel),), dtype=torch.uint8, generator=generator) for _ in range(2)]
    for packed, top in zip(moments, (1e-3, 1e-6), strict=True):
        scales = blocks(packed)[1]
        scales.copy_(torch.rand(scales.shape, generator=generator) * top)
    return [weights, gradient, *moments]


def tables(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return noise_table(seed, False, CPU), noise_table(seed + 1, False, CPU), noise_table(seed + 2, True, CPU)


def numpy_update(state: list[torch.Tensor], noise: tuple[torch.Tensor, ...], scale: float, mask) -> list[np.ndarray]:
    """The update's formula, transcribed into NumPy's fp32 arithmetic (each operation rounded as
    IEEE does, in the order ``compact_adamw_`` writes them): master, exp_avg, exp_avg_sq after."""
    f32 = np.float32
    lr, beta1, beta2, eps, decay, c1, c2_sqrt = HYPER.numpy()
    master, grad, exp_avg, exp_avg_sq = state
    numel = master.numel()
    w = master.float().numpy().copy()
    g = grad.float().numpy() * f32(scale)
    shrink = f32(1) - lr * decay
    w = np.where(mask.numpy(), w * shrink, w) if mask is not None else w * shrink
    rows = [packed.numpy().reshape(-1, BLOCK + 4) for packed in (exp_avg, exp_avg_sq)]
    full = (f32(127**2), f32(255**4))
    cm = rows[0][:, :BLOCK].view(np.int8).astype(f32)
    cv = rows[1][:, :BLOCK].astype(f32)
    m_old = (cm * np.abs(cm)) * (rows[0][:, BLOCK:].view(f32) / full[0])
    v_old = ((cv * cv) * (cv * cv)) * (rows[1][:, BLOCK:].view(f32) / full[1])
    g = g.reshape(-1, BLOCK)
    m = m_old + (g - m_old) * (f32(1) - beta1)
    v = v_old * beta2 + (g * g) * (f32(1) - beta2)
    w = w - ((lr / c1) * m / (np.sqrt(v) / c2_sqrt + eps)).reshape(-1)
    noises = [periodic(table, numel).numpy().reshape(-1, BLOCK) for table in noise]
    with np.errstate(divide="ignore"):
        m_abs, v_abs = np.abs(m).max(axis=1, keepdims=True), v.max(axis=1, keepdims=True)
        m_factor = np.where(m_abs > 0, full[0] / m_abs, f32(0))
        v_factor = np.where(v_abs > 0, full[1] / v_abs, f32(0))
    m_code = np.copysign(np.minimum(np.floor(np.sqrt(np.abs(m) * m_factor) + noises[0]), f32(127)), m)
    v_code = np.clip(np.floor(np.sqrt(np.sqrt(v * v_factor)) + noises[1]), f32(1), f32(255))
    moments = [
        np.concatenate([code.astype(dtype).view(np.uint8), top.astype(f32).view(np.uint8)], axis=1).reshape(-1)
        for code, dtype, top in ((m_code, np.int8, m_abs), (v_code, np.uint8, v_abs))
    ]
    if master.dtype == torch.bfloat16:
        bits = (w.view(np.uint32) + noises[2].reshape(-1).astype(np.uint32)) >> 16
        return [bits.astype(np.uint16), *moments]
    return [w, *moments]


def host(state: list[torch.Tensor], noise: tuple[torch.Tensor, ...], scale: float, mask, skip: float = 0.0) -> None:
    done = host_update.update(
        state[0], state[1], (state[2], state[3]), noise, HYPER, torch.tensor(scale), torch.tensor(skip), mask
    )
    assert done, "the host kernel took the shard"


def as_bytes(tensor: torch.Tensor) -> np.ndarray:
    return tensor.view(torch.uint16).numpy() if tensor.dtype == torch.bfloat16 else tensor.numpy()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("masked", [False, True], ids=["decay", "mask"])
@pytest.mark.parametrize("grad", [torch.bfloat16, torch.float32], ids=["bf16 grad", "fp32 grad"])
@pytest.mark.parametrize("master", [torch.bfloat16, torch.float32], ids=["bf16 master", "fp32 master"])
def test_the_kernel_computes_the_formula_bit_for_bit(master, grad, masked, threads, monkeypatch) -> None:
    """Blocks 0-300 (an odd count: the threads' parts differ in length), with a clipping scale,
    the noise of ``periodic`` (a shard longer than one period), a per-element decay mask."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    numel = 301 * BLOCK
    state = shard(numel, master, grad)
    noise = tables(7)
    mask = torch.rand(numel, generator=torch.Generator().manual_seed(1)) < 0.5 if masked else None
    expected = numpy_update(state, noise, 0.6, mask)
    host(state, noise, 0.6, mask)
    for name, got, want in zip(("master", "exp_avg", "exp_avg_sq"), (state[0], *state[2:]), expected, strict=True):
        mismatched = (as_bytes(got) != want).sum()
        assert mismatched == 0, f"{name}: {mismatched} of {want.size} differ"


def test_the_kernel_follows_torchs_rounding_of_the_same_function() -> None:
    """Torch's eager kernels compute the same formula but take sqrt to within an ulp (its
    vectorized sqrt is not correctly rounded): a value on a rounding boundary may then round the
    other way, a code or a master one step apart, and rarely (measured: about 1e-4 of them)."""
    noise, scale = tables(3), torch.tensor(0.9)
    ours, theirs = shard(64 * BLOCK, torch.bfloat16, torch.bfloat16), shard(64 * BLOCK, torch.bfloat16, torch.bfloat16)
    for _ in range(3):
        host(ours, noise, 0.9, None)
        held = compact_update.held
        compact_update.compact_adamw_(theirs[0], theirs[1], held(theirs[2]), held(theirs[3]), noise, HYPER, scale,
                                      torch.tensor(0.0))  # fmt: skip
    assert not torch.equal(ours[0], shard(64 * BLOCK, torch.bfloat16, torch.bfloat16)[0]), "the master moved"
    for got, want in zip(ours, theirs, strict=True):
        differ = (got != want).float().mean().item()
        assert differ < 2e-3, differ
    steps = (ours[0].view(torch.int16).int() - theirs[0].view(torch.int16).int()).abs()
    assert steps.max().item() <= 1, "a master differs by at most one bf16 step"


def test_a_skipped_shard_is_left_as_it_was() -> None:
    state = shard(4 * BLOCK, torch.bfloat16, torch.float32)
    before = [t.clone() for t in state]
    host(state, tables(0), 1.0, None, skip=1.0)
    assert all(torch.equal(a, b) for a, b in zip(state, before, strict=True))


def test_other_forms_and_strided_shards_are_left_to_the_torch_kernel() -> None:
    master, grad, m, v = shard(4 * BLOCK, torch.bfloat16, torch.float32)
    wide = torch.zeros(4 * BLOCK)
    assert host_update.serves(master, grad, (m, v))
    assert not host_update.serves(master, grad, (wide, wide)), "fp32 moments"
    assert not host_update.serves(master, grad, (wide.bfloat16(), wide.bfloat16())), "bf16 moments"
    assert not host_update.serves(master, grad, (m, v[:-1])), "a moment cut short"
    assert not host_update.serves(master, grad[:-BLOCK], (m, v)), "a gradient cut short"
    assert not host_update.serves(torch.zeros(8 * BLOCK, dtype=torch.bfloat16)[::2], grad, (m, v)), "strided"
    assert not host_update.takes(torch.device("cuda"), torch.bfloat16, torch.uint8, torch.bfloat16)


def test_without_a_compiler_the_torch_kernel_runs_after_one_warning(tmp_path, monkeypatch, caplog) -> None:
    """The update then gives what the torch kernel gives, in the same environment (whose missing
    compiler Inductor may heed too, and run its kernel uncompiled)."""

    def steps(state: list[torch.Tensor]) -> None:
        for count in (1, 2):
            compact_step(OptimConfig(), state[0], state[1], (state[2], state[3]), count, 1e-3, (1, 2, 3))

    monkeypatch.setattr(compact_update.ADAMW, "kernel", compact_update.ADAMW.kernel)  # restored after, if it falls back
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("OFFLOAD_KERNEL_CACHE", str(tmp_path / "cache"))
    native._load.cache_clear()
    try:
        expected, ours = (
            shard(8 * BLOCK, torch.bfloat16, torch.bfloat16),
            shard(8 * BLOCK, torch.bfloat16, torch.bfloat16),
        )
        with monkeypatch.context() as patch:
            patch.setattr(host_update, "kernel", lambda: None)
            steps(expected)
        with caplog.at_level(logging.WARNING):
            steps(ours)
        warned = [record.getMessage() for record in caplog.records if record.name == native.__name__]
        assert len(warned) == 1 and "host_adamw.c could not be built" in warned[0], warned
        assert all(torch.equal(a, b) for a, b in zip(ours, expected, strict=True)), "the torch kernel's result"
    finally:
        native._load.cache_clear()


def test_a_build_is_cached_and_shared(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OFFLOAD_KERNEL_CACHE", str(tmp_path))
    native._load.cache_clear()
    try:
        assert native.load(host_update.SOURCE) is not None
        built = list(tmp_path.iterdir())
        assert len(built) == 1 and built[0].suffix == ".so", built
        native._load.cache_clear()
        stamp = built[0].stat().st_mtime_ns
        assert native.load(host_update.SOURCE) is not None
        assert list(tmp_path.iterdir()) == built and built[0].stat().st_mtime_ns == stamp, "built again"
    finally:
        native._load.cache_clear()
