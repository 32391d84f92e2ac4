"""Weight decay per parameter (``optim.no_decay``): biases, norms and embeddings exempt by
default. In fp32 on one rank the engine is bit-identical to ``torch.optim.AdamW`` built with
two parameter groups, on every stage, tier and kernel; ``[]`` is one group; a pattern exempts
what it names; the compact forms leave an exempt parameter undecayed. The reference groups come
from ``tests.training.decay_groups``, rules written apart from the engine's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.config import ConfigError, OptimConfig
from engine.engine import Engine
from engine.state.partition import build_layout
from engine.state.quantize import packed_bytes
from engine.zero.compact_update import compact_step
from engine.zero.decay import ShardDecay, no_decay_names, shard_decay
from engine.zero.optim import ShardAdamW
from tests.training import _snapshot, batches, config, rel_diff, tiny_gpt, train_engine, train_reference

STEPS = 4
OPTIM = {"lr": 1e-2, "weight_decay": 0.5}
"""Decay strong enough that a parameter decayed by mistake is thousands of ulps off."""


def assert_bit_identical(ours: dict, ref: dict) -> None:
    assert ours["losses"] == ref["losses"]
    for step, (a, b) in enumerate(zip(ours["history"], ref["history"], strict=True)):
        differing = [name for name in b if not torch.equal(a[name], b[name])]
        assert not differing, f"step {step}: parameters differ from torch AdamW's two groups: {differing[:3]}"


@pytest.mark.parametrize("kernel", ["fused", "foreach"])
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp32_one_rank_is_bit_identical_to_adamw_with_two_groups(stage: int, tier: str, kernel: str, tmp_path) -> None:
    cfg = config(
        zero={"stage": stage},
        offload={"optimizer": tier, "nvme_path": str(tmp_path / "store")},
        optim={**OPTIM, "kernel": kernel},
    )
    assert cfg.optim.no_decay == ["bias", "norm", "embedding"], "the default"
    assert_bit_identical(train_engine(cfg, STEPS), train_reference(cfg, STEPS, micro_batch=4))


def test_an_empty_list_decays_every_parameter_as_one_group() -> None:
    everything = config(optim={**OPTIM, "no_decay": []})
    ours = train_engine(everything, STEPS)
    assert_bit_identical(ours, train_reference(everything, STEPS, micro_batch=4))
    exempting = train_engine(config(optim=OPTIM), STEPS)
    assert not torch.equal(ours["params"]["ln_f.weight"], exempting["params"]["ln_f.weight"]), "a gain decays"
    assert rel_diff(ours["params"], exempting["params"]) > 1e-4


def test_a_tied_head_follows_its_embedding() -> None:
    cfg = config(zero={"stage": 3}, optim=OPTIM)
    assert_bit_identical(train_engine(cfg, STEPS, tie=True), train_reference(cfg, STEPS, micro_batch=4, tie=True))
    model = tiny_gpt(tie=True)
    assert "tok_emb.weight" in no_decay_names(model, ["embedding"])
    assert "tok_emb.weight" in no_decay_names(model, ["head.weight"]), "a pattern over the head's name exempts the pair"


def test_a_custom_pattern_exempts_what_it_names() -> None:
    cfg = config(optim={**OPTIM, "no_decay": ["bias", "blocks.*.attn.*"]})
    ours = train_engine(cfg, STEPS)
    ref = train_reference(cfg, STEPS, micro_batch=4, exempt=lambda n, _: n.endswith("bias") or ".attn." in n)
    assert_bit_identical(ours, ref)
    names = no_decay_names(tiny_gpt(), cfg.optim.no_decay)
    assert "blocks.0.attn.qkv.weight" in names and "blocks.0.mlp.fc.bias" in names
    assert "blocks.0.mlp.fc.weight" not in names and "ln_f.weight" not in names and "tok_emb.weight" not in names


def test_norm_keyword_takes_hugging_face_norm_classes() -> None:
    class LlamaRMSNorm(nn.Module):  # named as Hugging Face names its own, an nn.Module of its own
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(8))

    model = nn.ModuleDict({"norm": LlamaRMSNorm(), "rms": nn.RMSNorm(8), "proj": nn.Linear(8, 8, bias=False)})
    assert no_decay_names(model, ["norm"]) == {"norm.weight", "rms.weight"}


def test_an_empty_entry_and_a_pattern_matching_nothing_are_refused(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"optim.no_decay = \['bias', ''\]: holds an empty entry"):
        config(optim={"no_decay": ["bias", ""]}).validate()
    store = tmp_path / "store"
    cfg = config(offload={"optimizer": "nvme", "nvme_path": str(store)}, optim={"no_decay": ["*.layer_norm.*"]})
    with pytest.raises(ValueError, match=r"'\*\.layer_norm\.\*', which matches no parameter of this model"):
        Engine(tiny_gpt(), cfg)
    assert not store.exists(), "refused before the store was made"


def test_shard_runs_merge_neighbours_and_cut_at_rank_boundaries() -> None:
    params = {"u": [(name, nn.Parameter(torch.zeros(n))) for name, n in (("a", 1000), ("b", 2000), ("c", 500))]}
    unit = build_layout(params, world_size=2, max_chunk_numel=2048).units[0]
    assert unit.shard_numel == 2048, "two shards, the second ending in 596 elements of padding"
    assert shard_decay(unit, 0, frozenset({"b"})).runs == ((0, 1000, True), (1000, 2048, False))
    assert shard_decay(unit, 1, frozenset({"b"})).runs == ((0, 952, False), (952, 2048, True)), "padding joins c"
    assert shard_decay(unit, 1, frozenset({"a", "c"})).uniform is None
    assert shard_decay(unit, 0, frozenset({"a", "b"})).uniform is False, "merged into one run"
    assert shard_decay(unit, 0, frozenset()).uniform is True
    mask = shard_decay(unit, 0, frozenset({"b"})).mask(torch.device("cpu"))
    assert mask.dtype == torch.bool and mask[:1000].all() and not mask[1000:].any()


def test_a_mask_written_over_the_last_one_holds_only_its_own_runs() -> None:
    """Masks share one buffer per thread: each sets every element of its length, whatever a
    longer or shorter one left there."""
    cpu = torch.device("cpu")
    for runs in (((0, 10, False), (10, 30, True)), ((0, 5, True), (5, 20, False)), ((0, 8, False), (8, 40, True))):
        expected = torch.cat([torch.full((stop - start,), decays) for start, stop, decays in runs])
        assert torch.equal(ShardDecay(runs).mask(cpu), expected)


@pytest.mark.parametrize("kernel", ["fused", "foreach"])
def test_a_shard_of_both_kinds_counts_each_step_once(kernel: str) -> None:
    """Each run has its own copy of the step count (torch's kernels add 1 to each they are
    given), so the shard's count and the bias correction advance once a step."""
    optim = OptimConfig(kernel=kernel, **OPTIM)
    sizes, exempt = [300, 64, 500, 7], [False, True, False, True]
    generator = torch.Generator().manual_seed(0)
    values = [torch.randn(n, generator=generator) for n in sizes]
    grads = [[torch.randn(n, generator=generator) for n in sizes] for _ in range(3)]
    params = [nn.Parameter(v.clone()) for v in values]
    groups = [
        {"params": [p for p, e in zip(params, exempt, strict=True) if e == skip], "weight_decay": wd}
        for skip, wd in ((False, optim.weight_decay), (True, 0.0))
    ]
    flags = {"fused": True} if kernel == "fused" else {}
    torch_opt = torch.optim.AdamW(groups, lr=optim.lr, betas=optim.betas, eps=optim.eps, **flags)
    opt = ShardAdamW(optim)
    counter = opt.new_step_counter(torch.device("cpu"))
    master, moments = torch.cat(values), (torch.zeros(sum(sizes)), torch.zeros(sum(sizes)))
    ends = torch.tensor(sizes).cumsum(0).tolist()
    decay = ShardDecay(tuple((end - n, end, not skip) for n, end, skip in zip(sizes, ends, exempt, strict=True)))
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        torch_opt.step()
        opt.update(master, torch.cat(step_grads), *moments, counter, optim.lr, decay=decay)
    assert counter.item() == len(grads)
    assert torch.equal(master, torch.cat([p.detach() for p in params]))


COMPACT = [("bf16", "fp32"), ("int8", "fp32"), ("fp32", "bf16"), ("int8", "bf16"), ("bf16", "bf16")]
"""(``state_dtype``, ``master_dtype``): every compact form."""


@pytest.mark.parametrize(("moments", "master"), COMPACT)
def test_the_compact_kernel_leaves_an_exempt_run_undecayed(moments: str, master: str) -> None:
    """With zero gradients (so zero moments and no Adam step) only the decay moves a weight:
    the decayed run shrinks, the exempt one stays put, a bf16 master's included (its values
    exact, its rounding adds nothing)."""
    n, dtype = 4096, torch.float32 if master == "fp32" else torch.bfloat16
    weights = torch.full((n,), 1.0, dtype=dtype)
    held = {"fp32": (torch.float32, n), "bf16": (torch.bfloat16, n), "int8": (torch.uint8, packed_bytes(n))}
    state = tuple(torch.zeros(held[moments][1], dtype=held[moments][0]) for _ in range(2))
    decay = ShardDecay(((0, 1000, True), (1000, 3000, False), (3000, n, True)))
    for step in (1, 2):
        compact_step(OptimConfig(**OPTIM), weights, torch.zeros(n), state, step, 1e-2, (1, 2, 3), decay=decay)
    assert torch.equal(weights[1000:3000], torch.ones(2000, dtype=dtype)), "the exempt run stays put"
    decayed = torch.cat([weights[:1000], weights[3000:]]).float()
    assert (decayed < 1).all() and decayed.mean().item() == pytest.approx((1 - 1e-2 * 0.5) ** 2, abs=2e-3)


class ZeroLoss(nn.Module):
    """The tiny GPT with its loss times 0: every gradient is 0, so only weight decay moves a weight."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = tiny_gpt()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.gpt(x, y) * 0.0


@pytest.mark.parametrize(("moments", "master"), [("int8", "fp32"), ("bf16", "bf16")])
def test_the_engine_in_compact_forms_leaves_exempt_parameters_undecayed(moments: str, master: str) -> None:
    cfg = config(optim={**OPTIM, "state_dtype": moments, "master_dtype": master})
    eng = Engine(ZeroLoss(), cfg, total_steps=3)
    data, history = batches(4), []
    for _ in range(3):
        eng.backward(eng(*data.next()))
        eng.step()
        with eng.gathered():
            history.append(_snapshot(eng.module))
    eng.close()
    first, last = history[0], history[-1]  # after a step, so that a bf16 master's first rounding is behind
    for name in first:
        exempt = first[name].ndim < 2 or name.endswith("emb.weight")
        if exempt:
            assert torch.equal(first[name], last[name]), f"{name} is exempt from decay, yet it moved"
        else:
            assert last[name].norm() < first[name].norm(), f"{name} decays, yet it did not shrink"
