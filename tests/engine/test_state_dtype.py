"""Compact optimizer state (``optim.state_dtype``): it tracks torch's fp32 AdamW, stores fewer
bytes, resumes bit-identically in its own form and is refused in another."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.engine import Engine
from engine.state.quantize import BLOCK, decode, encode, noise_table, periodic, round_bits
from engine.tools.consolidate import consolidate
from engine.tools.estimate import plan_of, run_shape, store_bytes
from engine.tools.inspect import format_report, inspect_store
from tests.engine.test_crafted_stores import snapshot
from tests.engine.test_resume import nvme, params, run
from tests.training import change_error, config, tiny_gpt, train_engine, train_reference

STEPS = 8
TRACK_TOLERANCE = {"bf16": 0.01, "int8": 0.05}
"""Largest ``||engine - torch|| / ||torch - initial||`` over the parameters' change: how far the
compact form may steer training from fp32 AdamW in ``STEPS`` steps. A bf16 moment carries 8
significant bits, so each step's update ``m / sqrt(v)`` is off by about 2**-9 relative, random
in sign (stochastic rounding); measured, 0.2% of the distance travelled after 8 steps. 1%
leaves room for the rounding noise to add up differently, while a biased form (rounding to
nearest freezing ``v``) or a wrong one (say, moments not kept between steps) is far beyond it.
An 8-bit code resolves about 1% of its block's largest value, so each update is off by about
1%: measured, 2.3%; 5% allows for the same doubling. (Before the least code of a positive
``v`` was made 1, a ``v`` decoded as 0 took steps of ``m / eps``: 11%.)"""


# Each tier and stage computes the same arithmetic (the tiers' bit-identity is tested apart):
# two of the six pairs in the default run, the rest slow.
TRACKED = [("cpu", 2), ("nvme", 3)] + [
    pytest.param(tier, stage, marks=pytest.mark.slow)
    for tier, stage in (("device", 2), ("device", 3), ("cpu", 3), ("nvme", 2))
]


@pytest.mark.parametrize(("tier", "stage"), TRACKED)
@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_compact_moments_track_torch_adamw(tmp_path, stage: int, tier: str, state_dtype: str) -> None:
    offload = {"optimizer": tier, "nvme_path": str(tmp_path / "store")}
    cfg = config(zero={"stage": stage}, offload=offload, optim={"state_dtype": state_dtype})
    got = train_engine(cfg, STEPS)
    expected = train_reference(cfg, STEPS, micro_batch=4)
    initial = {n: p.detach().clone() for n, p in tiny_gpt().named_parameters()}
    error = change_error(got["params"], expected["params"], initial)
    assert 0 < error < TRACK_TOLERANCE[state_dtype], error
    assert got["losses"][-1] < got["losses"][0]


def test_stochastic_rounding_is_exact_unbiased_and_seeded() -> None:
    value = torch.full((200_000,), 1.0 + 2**-10)  # a quarter of the way between two bfloat16 values

    def rounded(seed: int) -> torch.Tensor:
        return round_bits(value, periodic(noise_table(seed, True, value.device), value.numel()))

    out = rounded(3)
    assert set(out.float().unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert abs(out.float().mean().item() - (1.0 + 2**-10)) < 2**-7 * 0.01
    assert torch.equal(out, rounded(3))
    assert not torch.equal(out, rounded(4))


@pytest.mark.parametrize("signed", [True, False])
def test_8bit_blocks_keep_signs_and_are_unbiased(signed: bool) -> None:
    """Values over six orders of magnitude in each block, as a moment's are: one rounding is
    within 1% overall, the mean of 20 seeded roundings within 0.3% (the error averages out), and
    no sign flips, and no positive second moment stored as 0."""
    torch.manual_seed(0)
    n = 1 << 16
    values = torch.randn(n) * torch.logspace(-6, 0, n)[torch.randperm(n)]
    values = values if signed else values.square()
    decoded = []
    for seed in range(20):
        noise = periodic(noise_table(seed, False, values.device), n)
        codes, scales = encode(values.view(-1, BLOCK), noise.view(-1, BLOCK), signed)
        decoded.append(decode(codes, scales, signed).view(-1))
    assert ((decoded[0] - values).norm() / values.norm()).item() < 0.01
    assert ((torch.stack(decoded).mean(0) - values).norm() / values.norm()).item() < 0.003
    assert not (decoded[0] * values < 0).any()
    assert signed or (decoded[0][values > 0] > 0).all()


def state_bytes(store: Path) -> int:
    """Bytes of the optimizer state arrays in a store's live generations, as on disk."""
    kinds = ("master", "exp_avg", "exp_avg_sq")
    return sum(f.stat().st_size for f in store.rglob("*") if f.is_file() and any(f"/{k}/" in str(f) for k in kinds))


def test_compact_stores_hold_fewer_bytes(tmp_path) -> None:
    sizes = {}
    for state_dtype in ("fp32", "bf16", "int8"):
        cfg = nvme(tmp_path / state_dtype, optim={"state_dtype": state_dtype})
        eng = Engine(tiny_gpt(), cfg, total_steps=2)
        run(eng, 2)
        eng.close()
        sizes[state_dtype] = state_bytes(tmp_path / state_dtype / "store")
        predicted = store_bytes(run_shape(cfg, 1, model=tiny_gpt()), plan_of(cfg))
        assert predicted <= sizes[state_dtype] <= 1.01 * predicted  # what `estimate` says, CRCs aside
    # per element 4 + 2 + 2 bytes, or 4 + 2 x (1 + 4/256) with a block's scale, against 4 + 4 + 4
    assert sizes["bf16"] / sizes["fp32"] == pytest.approx(8 / 12, rel=0.01)
    assert sizes["int8"] / sizes["fp32"] == pytest.approx((4 + 2 * 260 / 256) / 12, rel=0.01)


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_compact_state_resumes_bit_identically(tmp_path, state_dtype: str) -> None:
    cfg = {"optim": {"state_dtype": state_dtype}}
    straight = Engine(tiny_gpt(), nvme(tmp_path / "a", 3, **cfg), total_steps=6)
    expected_losses, expected = run(straight, 6), params(straight)
    straight.close()
    first = Engine(tiny_gpt(), nvme(tmp_path / "b", 3, **cfg), total_steps=6)
    losses = run(first, 3)
    first.close()
    resumed = Engine.resume(tiny_gpt(), nvme(tmp_path / "b", 3, **cfg), total_steps=6)
    losses += run(resumed, 3)
    got = params(resumed)
    resumed.close()
    assert losses == expected_losses
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_resume_in_another_form_is_refused_untouched(tmp_path) -> None:
    eng = Engine(tiny_gpt(), nvme(tmp_path, optim={"state_dtype": "bf16"}), total_steps=2)
    run(eng, 1)
    eng.close()
    before = snapshot(tmp_path)
    with pytest.raises(
        ValueError, match=r"state_dtype = 'bf16', this run asks for 'fp32': set optim.state_dtype = 'bf16'"
    ) as refused:
        Engine.resume(tiny_gpt(), nvme(tmp_path), total_steps=2)
    assert "\n" not in str(refused.value)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(("state_dtype", "moment_share"), [("bf16", 1 / 2), ("int8", 260 / 256 / 4)])
def test_inspect_names_the_form_and_consolidate_reads_the_masters(
    tmp_path, state_dtype: str, moment_share: float
) -> None:
    eng = Engine(tiny_gpt(), nvme(tmp_path, optim={"state_dtype": state_dtype}), total_steps=2)
    run(eng, 2)
    trained = params(eng)
    eng.close()
    report = inspect_store(tmp_path / "store")
    assert report["state_dtype"] == state_dtype
    sizes = report["bytes_per_kind"]
    assert sizes["exp_avg"] == sizes["exp_avg_sq"] == sizes["master"] * moment_share
    assert f"optim.state_dtype = {state_dtype!r}" in format_report(report)
    assert consolidate(tmp_path / "store", tmp_path / "model.safetensors") == len(trained)
    weights = load_file(tmp_path / "model.safetensors")
    assert all(torch.equal(weights[name], trained[name]) for name in trained)


def test_a_memory_tier_checkpoint_in_another_form_is_refused_untouched(tmp_path) -> None:
    cpu = {"optimizer": "cpu", "nvme_path": str(tmp_path / "store")}
    eng = Engine(tiny_gpt(), config(offload=cpu, optim={"state_dtype": "int8"}), total_steps=2)
    run(eng, 1)
    eng.save("a")
    eng.close()
    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match=r"state_dtype = 'int8', this run asks for 'bf16'"):
        Engine.resume(tiny_gpt(), config(offload=cpu, optim={"state_dtype": "bf16"}), total_steps=2, checkpoint="a")
    assert snapshot(tmp_path) == before
