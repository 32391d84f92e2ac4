"""A Mixtral-style mixture-of-experts model (a router and stacked experts in each layer) trained
by the engine: bit-identical to ``torch.optim.AdamW`` in fp32 on one rank at every stage with
its state on each tier, within tolerance on two ranks. Its experts can be units of their own
inside their layer's unit (``zero.unit_classes`` naming both classes), which the device budget
and ``estimate`` account for."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from engine.config import Config  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.run.pretrained import read_headers  # noqa: E402
from engine.runtime.budget import DeviceMemoryError  # noqa: E402
from engine.tools.estimate import run_shape  # noqa: E402
from tests.caches import fresh_cache  # noqa: E402
from tests.ranks import run_ranks  # noqa: E402
from tests.training import SEQ_LEN, batches, config, reference_adamw  # noqa: E402

STEPS = 3
NESTED = ["MixtralDecoderLayer", "MixtralExperts"]
# A constant rate after no warmup: the reference needs no schedule of the engine's to follow.
OPTIM = {"warmup_steps": 0, "schedule": "constant"}


def mixtral() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(
        transformers.MixtralConfig(
            vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=SEQ_LEN,
        )
    ).float()  # fmt: skip


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train_engine(cfg, rank: int = 0, world_size: int = 1) -> tuple[list[float], dict[str, torch.Tensor]]:
    eng = Engine(mixtral(), cfg, total_steps=STEPS)
    data, losses = batches(4, rank, world_size), []
    for _ in range(STEPS):
        x = data.next()[0]
        loss = eng(input_ids=x, labels=x).loss
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
    with eng.gathered():
        params = snapshot(eng.module)
    eng.close()
    return losses, params


def train_torch(cfg, micro_batch: int = 4) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = mixtral()
    opt = reference_adamw(model, cfg.optim)
    data, losses = batches(micro_batch), []
    for _ in range(STEPS):
        x = data.next()[0]
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, snapshot(model)


PLANS = [
    (1, "cpu", "device"),
    (2, "nvme", "device"),
    (3, "cpu", "cpu"),
    (3, "nvme", "nvme"),
]


@pytest.mark.parametrize(("stage", "optimizer", "param"), PLANS, ids=[f"stage{s}-{o}-{p}" for s, o, p in PLANS])
@pytest.mark.parametrize("units", [[], NESTED], ids=["layers", "experts-nested"])
def test_one_rank_is_bit_identical_to_torch_adamw(stage, optimizer, param, units, tmp_path: Path) -> None:
    cfg = config(
        zero={"stage": stage, "prefetch_mb": 1, "unit_classes": units},
        offload={"optimizer": optimizer, "param": param, "nvme_path": str(tmp_path / "store")},
        optim=OPTIM,
    )
    losses, ours = train_engine(cfg)
    ref_losses, ref = train_torch(cfg)
    assert losses == ref_losses and losses[-1] < losses[0]
    for name in ref:
        assert torch.equal(ours[name], ref[name]), f"{name} differs from torch AdamW"


def test_nested_units_hold_the_experts_apart_from_their_layer(tmp_path: Path) -> None:
    cfg = config(zero={"stage": 3, "unit_classes": NESTED}, offload={"nvme_path": str(tmp_path / "s")}, optim=OPTIM)
    eng = Engine(mixtral(), cfg, total_steps=STEPS)
    units = {u.name: {s.name for s in u.params} for u in eng.layout.units}
    eng.close()
    assert units["model.layers.0.mlp.experts"] == {
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.experts.down_proj",
    }
    assert "model.layers.0.mlp.gate.weight" in units["model.layers.0"], "the router stays with its layer"
    assert not units["model.layers.0"] & units["model.layers.0.mlp.experts"]


def _two_ranks(cfg) -> tuple[list[float], dict[str, torch.Tensor]]:
    return train_engine(cfg, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))


@pytest.mark.slow
def test_two_ranks_at_stage_3_on_nvme_track_torch_adamw(tmp_path: Path) -> None:
    """Two ranks each take half of a batch of 8; the reference takes the batch whole. The sums
    run in another order, so the bound is a tolerance: 1e-5 relative, where the first step's
    update alone moves a parameter by about 1e-3 of its norm."""
    cfg = config(
        zero={"stage": 3, "prefetch_mb": 1, "unit_classes": NESTED},
        offload={"optimizer": "nvme", "param": "nvme", "nvme_path": str(tmp_path / "store")},
        optim=OPTIM,
    )
    results = run_ranks(2, _two_ranks, cfg)
    _, ref = train_torch(cfg, micro_batch=8)
    assert results[0][1].keys() == ref.keys()
    for name in ref:
        assert torch.equal(results[0][1][name], results[1][1][name]), "the ranks agree"
        gap = (results[0][1][name] - ref[name]).norm() / ref[name].norm()
        assert gap < 1e-5, f"{name}: {gap:.2e} from torch AdamW"


def test_experts_over_the_device_limit_are_refused_naming_the_size_that_fits(tmp_path: Path) -> None:
    cfg = config(
        zero={"stage": 3, "unit_classes": NESTED, "device_memory_limit_mb": 0.5},
        offload={"param": "cpu", "nvme_path": str(tmp_path / "s")},
    )
    with pytest.raises(
        DeviceMemoryError, match=r"unit 'model\.layers\.\d\.mlp\.experts' \(inside 'model\.layers\.\d'\).*at least"
    ):
        Engine(mixtral(), cfg, total_steps=STEPS)


def test_estimate_lays_out_and_sizes_the_experts_as_the_engine_does(tmp_path: Path) -> None:
    folder = tmp_path / "config-only"
    mixtral().config.save_pretrained(folder)
    cfg = Config.from_dict(
        {
            "model": {"hf": str(folder)},
            "zero": {"stage": 3, "unit_classes": NESTED},
            "offload": {"optimizer": "nvme", "param": "nvme", "nvme_path": str(tmp_path / "store")},
            "precision": {"compute_dtype": "fp32"},
            "data": {"seq_len": SEQ_LEN, "micro_batch": 2},
        }
    )
    run = run_shape(cfg, world_size=1)
    model = mixtral()
    eng = Engine(model, cfg, total_steps=1)
    try:
        assert run.layout == eng.layout
    finally:
        eng.close()
    assert run.layout.numel == sum(p.numel() for p in model.parameters())
    assert len(run.layout.units) == 2 * 2 + 1, "each layer's experts, the rest of each layer, the root"
    assert run.model.ffn == 2 * 96, "a token passes through the two experts it is routed to"


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_command_line_fine_tunes_exports_and_generates_a_mixture_of_experts(lora, tmp_path, monkeypatch) -> None:
    """A Mixtral checkpoint (experts stored one per tensor) fine-tuned from the command line at
    stage 3 on nvme, its experts in units of their own, with every weight trained or with LoRA
    adapters on the attention projections; the export loads in transformers (with peft for the
    adapters), and ``generate`` decodes greedily as that loaded model does."""
    peft = pytest.importorskip("peft")
    from engine.run import cli
    from engine.run.generate import Sampling, continue_ids, recorded_model
    from tests.engine.test_pretrained import SHARD, TEXT, save_tokenizer

    monkeypatch.setenv("XDG_CACHE_HOME", fresh_cache(tmp_path / "cache"))
    folder, store, out = tmp_path / "pretrained", tmp_path / "store", tmp_path / "out"
    model = mixtral()
    model.resize_token_embeddings(320)
    model.save_pretrained(folder, max_shard_size=SHARD)
    save_tokenizer(folder)
    (tmp_path / "corpus.txt").write_text(TEXT)
    args = ["train", "--model.hf", str(folder), "--data.source", str(tmp_path / "corpus.txt"), "--steps", "2"]
    args += ["--seq_len", "16", "--micro_batch", "2", "--nvme_path", str(store), "--stage", "3", "--param", "nvme"]
    args += ["--compute_dtype", "fp32", "--zero.unit_classes", '["MixtralDecoderLayer", "MixtralExperts"]']
    args += ["--lora.r", "4", "--lora.target_modules", '["q_proj", "v_proj"]'] if lora else []
    assert cli.main(args) == 0
    assert cli.main(["export", str(store), str(out)]) == 0
    if lora:
        loaded = peft.AutoPeftModelForCausalLM.from_pretrained(out)
    else:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
        assert set(read_headers(out)) == set(read_headers(folder)), "stored one tensor per expert, as it came"
    prompt = transformers.AutoTokenizer.from_pretrained(folder)("the quick")["input_ids"]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(loaded(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    same = [
        "--nvme_path",
        str(store),
        "--stage",
        "3",
        "--param",
        "nvme",
        "--zero.unit_classes",
        args[args.index("--zero.unit_classes") + 1],
    ]
    cfg = recorded_model(cli._load_config(None, same))
    assert continue_ids(cfg, prompt, Sampling(tokens=6, temperature=0)) == ids[len(prompt) :]
