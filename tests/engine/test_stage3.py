"""Stage 3: a unit's full parameters exist only while it runs."""

from __future__ import annotations

import functools

import pytest
import torch

from engine.engine import Engine
from engine.run.models.gpt import GPT, init_parameters_
from engine.state.partition import ROOT_UNIT
from engine.zero.params import ShardedParams
from engine.zero.unit_params import UnitState
from tests.training import batches, config, tiny_gpt, train_engine, train_reference


def test_units_are_gathered_only_while_they_run(monkeypatch) -> None:
    eng = Engine(tiny_gpt(), config(zero={"stage": 3, "prefetch_mb": 0}), total_steps=2)
    params = eng.params
    assert isinstance(params, ShardedParams)
    assert all(s is UnitState.SHARDED for s in params.state.values()), "nothing is gathered before the first forward"
    resident = eng.budget.used
    most = 0
    gather = ShardedParams.gather

    def counting(self, name):
        nonlocal most
        gather(self, name)
        blocks = [n for n, s in self.state.items() if s is not UnitState.SHARDED and n != ROOT_UNIT]
        most = max(most, len(blocks))

    monkeypatch.setattr(ShardedParams, "gather", counting)
    data = batches(4)
    for _ in range(2):
        eng.backward(eng(*data.next()))
        eng.step()
        assert all(s is UnitState.SHARDED for s in params.state.values()), params.state
        assert eng.budget.used == resident, "every gathered unit and gradient bucket was given back"
    assert most == 1, f"{most} blocks were gathered at once"
    whole_model = sum(u.padded_numel for u in eng.layout.units) * 4
    assert eng.last_step_stats.device_high_water < resident + whole_model, "never was the whole model gathered"
    with eng.gathered():
        assert all(torch.isfinite(p).all() for p in eng.module.parameters())
    assert all(s is UnitState.SHARDED for s in params.state.values())
    eng.close()


@pytest.mark.parametrize("stage", [2, 3])
def test_activation_checkpointing_is_bit_identical(stage: int) -> None:
    cfg = config(zero={"stage": stage, "activation_checkpointing": True})
    ours = train_engine(cfg, 4)
    ref = train_reference(cfg, 4, micro_batch=4)
    assert ours["losses"] == ref["losses"]
    assert all(torch.equal(ours["params"][k], ref["params"][k]) for k in ref["params"])


def test_activation_checkpointing_keeps_fewer_activations() -> None:
    def saved_bytes(checkpointing: bool) -> int:
        eng = Engine(tiny_gpt(), config(zero={"stage": 3, "activation_checkpointing": checkpointing}), total_steps=1)
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = eng(*batches(4).next())
        eng.backward(loss)
        eng.close()
        return total

    assert saved_bytes(True) < 0.5 * saved_bytes(False)


@pytest.mark.parametrize(("stage", "tie"), [(2, False), (3, False), (3, True)])
def test_a_meta_model_built_unit_by_unit_by_the_engine_equals_an_eager_one(tmp_path, stage: int, tie: bool) -> None:
    """What ``python -m engine train`` does: the model never exists whole in memory."""
    cfg = config(zero={"stage": stage}, offload={"optimizer": "nvme", "nvme_path": str(tmp_path / "store")})
    eager = tiny_gpt(tie=tie)
    with torch.device("meta"):
        meta = GPT(eager.config)
    eng = Engine(meta, cfg, init_unit=functools.partial(init_parameters_, config=meta.config, seed=0))
    with eng.gathered():
        assert all(
            torch.equal(a, b) for (_, a), (_, b) in zip(eager.named_parameters(), meta.named_parameters(), strict=False)
        )
    eng.close()
    with torch.device("meta"):
        uninitialised = GPT(eager.config)
    with pytest.raises(ValueError, match="meta device: pass init_unit="):
        Engine(uninitialised, config(offload={"nvme_path": str(tmp_path / "other")}))
