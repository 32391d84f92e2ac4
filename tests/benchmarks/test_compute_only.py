"""The compute floor of the step bounds: timed in the dtype the run computes in, for the
decoders the benchmarks train, and a validation's forward counted in the step after it, whose
clock holds it."""

from __future__ import annotations

import pytest
import torch

from benchmarks import giant
from benchmarks.compute_only import hf_compute_seconds, run_dtype
from benchmarks.llama_checkpoint import model_config
from engine.config import Config
from engine.runtime.native_dtype import native_compute_dtype
from engine.state.dtypes import DTYPES
from engine.tiers.store_io import settle_io


def test_auto_is_timed_in_the_dtype_the_engine_settles_and_a_set_dtype_as_set():
    assert run_dtype(Config.from_dict({})) == DTYPES[native_compute_dtype()[0]]
    assert run_dtype(Config.from_dict({"precision": {"compute_dtype": "bf16"}})) == torch.bfloat16


def test_giant_times_its_floor_in_the_runs_dtype(tmp_path, monkeypatch):
    """Not in bf16 always: where ``auto`` computes in fp32, a bf16 floor is ~70x the run's."""
    timed_in = []
    monkeypatch.setattr(giant, "gpt_compute_seconds", lambda gpt, batch, dtype, reps: timed_in.append(dtype) or 1.0)
    args = giant.parse_args(["--quick", "--params", "2e7"])
    config = giant.train_config(giant.run_config(args, tmp_path / "store", tmp_path / "metrics.jsonl"))
    config, _ = settle_io(config, resume=False)  # as giant's main settles it
    giant.measure_bound(tmp_path, config, giant.gpt_of(config), 1, quick=True)
    assert timed_in == [DTYPES[native_compute_dtype()[0]]]


@pytest.mark.parametrize("moe", [False, True], ids=["llama", "mixtral"])
def test_each_mode_is_timed_for_the_benchmarks_decoders(moe):
    modes = ("train", "recompute", "forward")
    seconds = hf_compute_seconds(model_config(2e7, 512, moe, 512), torch.Size((1, 32)), torch.float32, modes, reps=1)
    assert set(seconds) == set(modes)
    assert all(s > 0 for s in seconds.values())


def test_a_validation_is_bound_in_the_step_after_it_whose_clock_holds_it():
    """The validation after step 2 runs before step 3's first forward, in step 3's seconds; the
    one after the first run's last step, in no step of the resumed run's."""
    records = [
        {"step": step, "loss": 1.0, "seconds": 12.0, "compute_s": 11.0, "param_wait_s": 0.0, "optimizer_wait_s": 0.0}
        | {
            "bytes_read": 1e9,
            "bytes_written": 1e9,
            "prefetch_hit_rate": 1.0,
            "peak_rss_bytes": 0,
            "device_high_water": 0,
        }
        for step in (1, 2, 3, 4, 5)
    ]
    for validating in (1, 3):  # steps 2 and 4
        records[validating]["val_loss"] = 1.0
    runs = ["first"] * 4 + ["resumed"]
    bound = {"read_gbps": 1.0, "write_gbps": 1.0, "compute_s": 10.0, "eval_s": 3.0, "mixed_gbps": 0.5}
    rows = giant.step_rows(records, runs, bound)
    assert [r["bound s"] for r in rows] == [10.0, 10.0, 13.0, 10.0, 10.0]
    assert [r["mixed bound s"] for r in rows] == [10.0, 10.0, 13.0, 10.0, 10.0]
    records[0]["bytes_read"] = 20e9  # the disk's 21 s over the compute's 10
    assert giant.step_rows(records, runs, bound)[0]["bound s"] == 21.0
