"""The causal-LM loss over chunks of tokens (``engine.run.loss``): equal to the plain loss of
the whole micro-batch's logits and to its gradients, for the function, the built-in GPT, a
Hugging Face model (``causal_lm_loss``) and through the engine at stages 2 and 3, while it
keeps no logits for backward and never makes more than one chunk's; and packed examples
(``positions``) that see only themselves."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from engine.engine import Engine
from engine.run import loss as loss_module
from engine.run.loss import IGNORE_INDEX, chunked_cross_entropy
from engine.run.models.gpt import GPT
from engine.state.partition import ROOT_UNIT
from engine.zero.unit_params import UnitState
from tests.training import SEQ_LEN, batches, config, reference_adamw, reference_schedule, rel_diff, tiny_gpt

os.environ.setdefault("HF_HUB_OFFLINE", "1")

EXACT = 1e-6
"""fp32: the chunked loss sums its tokens' losses in another order than the plain one, and
its softmax's gradient is ``exp(x - logsumexp)`` rather than autograd's ``exp(log_softmax)``:
rounding, a few units in the 7th digit."""
BF16_GRAD = 2**-6
"""bf16 (8 significant bits): both losses round the logits' gradient to bf16, and the head's
gradient, once for the plain loss, once per chunk for the chunked one (summed in fp32): two
units in the last place of the largest element at most (measured: under one)."""
STEPS = 2


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference over the largest magnitude: per element would blow up rounding
    noise on the elements whose value is near zero."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def full_loss(hidden, weight, targets, bias=None) -> torch.Tensor:
    """The plain loss: every token's fp32 logits at once."""
    return F.cross_entropy(F.linear(hidden, weight, bias).float().flatten(0, 1), targets.flatten())


def problem(dtype: torch.dtype = torch.float32, batch: int = 3, seq: int = 37, d: int = 16, vocab: int = 200):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(batch, seq, d, generator=generator).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, d, generator=generator) * 0.3).to(dtype).requires_grad_()
    bias = (torch.randn(vocab, generator=generator) * 0.1).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (batch, seq), generator=generator)
    targets[0, :9] = IGNORE_INDEX  # a prompt
    targets[2, -5:] = IGNORE_INDEX  # padding
    return hidden, weight, bias, targets


# ------------------------------------------------------------------ the function


@pytest.mark.parametrize("chunk", [1, 10, 37, 111, 4096], ids=lambda c: f"chunk{c}")
def test_equals_the_full_loss_and_its_gradients_in_fp32(chunk: int) -> None:
    """111 tokens: chunks of 10 and 37 do not divide them, 1 and 4096 are the extremes."""
    hidden, weight, bias, targets = problem()
    ours = chunked_cross_entropy(hidden, weight, targets, bias, chunk_tokens=chunk)
    ref = full_loss(hidden, weight, targets, bias)
    assert ours.dtype == torch.float32
    grads = torch.autograd.grad(ours, (hidden, weight, bias))
    ref_grads = torch.autograd.grad(ref, (hidden, weight, bias))
    assert relative(ours, ref) <= EXACT
    for name, g, r in zip(("hidden", "weight", "bias"), grads, ref_grads, strict=True):
        assert relative(g, r) <= EXACT, f"{name}: {relative(g, r):.2e}"


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16-tensors", "autocast"])
def test_follows_the_full_loss_in_bf16(autocast: bool) -> None:
    hidden, weight, bias, targets = problem(torch.float32 if autocast else torch.bfloat16)
    context = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    with context:
        ours = chunked_cross_entropy(hidden, weight, targets, bias, chunk_tokens=10)
        ref = full_loss(hidden, weight, targets, bias)
    grads = torch.autograd.grad(ours, (hidden, weight, bias))
    ref_grads = torch.autograd.grad(ref, (hidden, weight, bias))
    assert relative(ours, ref) <= EXACT, "the same bf16 logits, summed in fp32"
    for name, g, r in zip(("hidden", "weight", "bias"), grads, ref_grads, strict=True):
        assert g.dtype == r.dtype
        assert relative(g, r) <= BF16_GRAD, f"{name}: {relative(g, r):.2e}"


def test_no_counted_token_gives_a_zero_that_goes_backward() -> None:
    hidden, weight, bias, targets = problem()
    loss = chunked_cross_entropy(hidden, weight, torch.full_like(targets, IGNORE_INDEX), bias, chunk_tokens=10)
    loss.backward()
    assert loss.item() == 0.0 and loss.grad_fn is not None
    assert all(p.grad is not None and not p.grad.any() for p in (hidden, weight, bias))


def test_refuses_targets_that_do_not_match() -> None:
    hidden, weight, _, targets = problem()
    with pytest.raises(ValueError, match="one target per token"):
        chunked_cross_entropy(hidden, weight, targets[:, 1:])
    with pytest.raises(ValueError, match="chunk_tokens must be a positive"):
        chunked_cross_entropy(hidden, weight, targets, chunk_tokens=0)


# ------------------------------------------------------------------ memory

TOKENS, VOCAB, WIDTH, CHUNK = 512, 1000, 16, 64
"""A vocabulary wide against the model, as in a real LM: one chunk's fp32 logits (250 KiB)
outweigh the head's weight (62.5 KiB) and the hidden states (32 KiB)."""


def _memory_problem():
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, TOKENS, WIDTH, generator=generator).requires_grad_()
    weight = (torch.randn(VOCAB, WIDTH, generator=generator) * 0.3).requires_grad_()
    targets = torch.randint(0, VOCAB, (1, TOKENS), generator=generator)
    return hidden, weight, targets


def _losses():
    return {
        "chunked": lambda h, w, t: chunked_cross_entropy(h, w, t, chunk_tokens=CHUNK),
        "full": full_loss,
    }


def saved_bytes(loss_of) -> int:
    """Bytes that autograd keeps from the loss's forward to its backward."""
    hidden, weight, targets = _memory_problem()
    total, seen = 0, set()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if tensor.data_ptr() not in seen:  # one tensor saved by two ops is kept once
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_of(hidden, weight, targets)
    loss.backward()
    return total


class LargestTensor(TorchDispatchMode):
    """The largest tensor any op makes while it is on, forward and backward."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def largest_tensor(loss_of) -> int:
    hidden, weight, targets = _memory_problem()
    with LargestTensor() as mode:
        loss_of(hidden, weight, targets).backward()
    return mode.largest


def test_keeps_no_logits_for_backward() -> None:
    logits = TOKENS * VOCAB * 4
    inputs = TOKENS * WIDTH * 4 + VOCAB * WIDTH * 4 + TOKENS * 8  # hidden, weight, targets
    chunked, full = saved_bytes(_losses()["chunked"]), saved_bytes(_losses()["full"])
    print(f"saved for backward: chunked {chunked} B, full {full} B, all fp32 logits {logits} B")
    assert full >= logits, "the plain loss keeps every token's fp32 log-softmax"
    assert chunked <= inputs + 64, "the chunked loss keeps its inputs and a scalar, no logits"


def test_makes_no_tensor_larger_than_one_chunk_of_logits() -> None:
    chunk_logits = CHUNK * VOCAB * 4
    chunked, full = largest_tensor(_losses()["chunked"]), largest_tensor(_losses()["full"])
    print(f"largest tensor: chunked {chunked} B, full {full} B, one chunk's fp32 logits {chunk_logits} B")
    assert chunked <= chunk_logits
    assert full >= TOKENS * VOCAB * 4


# ------------------------------------------------------------------ the built-in GPT


def test_the_gpts_loss_equals_the_full_loss_of_its_logits(monkeypatch) -> None:
    monkeypatch.setattr(loss_module, "CHUNK_TOKENS", 50)  # 4 x 32 tokens: 3 chunks, the last short
    x, y = batches(4).next()
    y[:, :6] = IGNORE_INDEX
    ours, ref = tiny_gpt(), tiny_gpt()
    loss = ours(x, y)
    ref_loss = F.cross_entropy(ref(x).float().flatten(0, 1), y.flatten())
    loss.backward()
    ref_loss.backward()
    assert relative(loss, ref_loss) <= EXACT
    for (name, p), r in zip(ours.named_parameters(), ref.parameters(), strict=True):
        assert relative(p.grad, r.grad) <= EXACT, f"{name}: {relative(p.grad, r.grad):.2e}"


def packed_row(lengths=(9, 7), vocab: int = 256):
    """Examples of ``lengths`` tokens, alone and packed into one row with their positions."""
    generator = torch.Generator().manual_seed(3)
    alone = [torch.randint(0, vocab, (1, n), generator=generator) for n in lengths]
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    return alone, torch.cat(alone, dim=1), positions


def per_token(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each position's loss of predicting the next token of its own example."""
    return F.cross_entropy(logits[0, :-1].float(), ids[0, 1:], reduction="none")


def split_per_token(logits: torch.Tensor, packed: torch.Tensor, lengths=(9, 7)) -> list[torch.Tensor]:
    parts, start = [], 0
    for n in lengths:
        parts.append(per_token(logits[:, start : start + n], packed[:, start : start + n]))
        start += n
    return parts


def test_packed_examples_in_the_gpt_see_only_themselves() -> None:
    model = tiny_gpt()
    alone, packed, positions = packed_row()
    together = split_per_token(model(packed, positions=positions), packed)
    for ids, ours in zip(alone, together, strict=True):
        assert relative(ours, per_token(model(ids), ids)) <= EXACT
    assert torch.equal(model(packed, positions=torch.arange(16).unsqueeze(0)), model(packed)), "one example: no change"


def test_the_gpt_refuses_positions_where_they_cannot_go() -> None:
    model = tiny_gpt()
    _, packed, positions = packed_row()
    with pytest.raises(TypeError, match="by keyword, positions="):
        model(packed, None, positions)
    with pytest.raises(ValueError, match="one position per token"):
        model(packed, positions=positions[:, 1:])


# ------------------------------------------------------------------ Hugging Face


def llama(vocab: int = 256) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ_LEN,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").float()


class Plain:
    """What ``causal_lm_loss`` asks of an engine, on plain PyTorch: the module, and a call."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def test_packed_examples_in_a_llama_see_only_themselves() -> None:
    from engine.run.pretrained import causal_lm_loss

    model = llama()
    alone, packed, positions = packed_row()
    together = split_per_token(model(input_ids=packed, position_ids=positions, use_cache=False).logits, packed)
    ref = [per_token(model(input_ids=ids).logits, ids) for ids in alone]
    for ours, theirs in zip(together, ref, strict=True):
        assert relative(ours, theirs) <= EXACT
    targets = torch.cat([torch.cat([ids[:, 1:], torch.tensor([[IGNORE_INDEX]])], dim=1) for ids in alone], dim=1)
    loss = causal_lm_loss(Plain(model), packed, targets, positions)
    assert relative(loss, torch.cat(ref).mean()) <= EXACT, "the boundary token is not counted"


def test_causal_lm_loss_equals_the_full_loss_of_the_logits(monkeypatch) -> None:
    from engine.run.pretrained import causal_lm_loss

    monkeypatch.setattr(loss_module, "CHUNK_TOKENS", 50)
    ours, ref = llama(), llama()
    x, y = batches(4).next()
    y[:, :6] = IGNORE_INDEX
    loss = causal_lm_loss(Plain(ours), x, y)
    ref_loss = F.cross_entropy(ref(input_ids=x).logits.float().flatten(0, 1), y.flatten())
    loss.backward()
    ref_loss.backward()
    assert relative(loss, ref_loss) <= EXACT
    for (name, p), r in zip(ours.named_parameters(), ref.parameters(), strict=True):
        assert relative(p.grad, r.grad) <= EXACT, f"{name}: {relative(p.grad, r.grad):.2e}"


def test_causal_lm_loss_refuses_logits_changed_after_the_head() -> None:
    from engine.run.pretrained import causal_lm_loss

    model = llama()
    model.lm_head.register_forward_hook(lambda module, args, out: 30 * torch.tanh(out / 30))  # Gemma 2's soft cap
    x, y = batches(1).next()
    with pytest.raises(ValueError, match="not its output head applied to its last hidden state"):
        causal_lm_loss(Plain(model), x, y)


# ------------------------------------------------------------------ through the engine


def engine_config(stage: int, tmp_path):
    offload = {"optimizer": "nvme", "nvme_path": str(tmp_path / "store")}
    if stage == 3:
        offload["param"] = "nvme"
    return config(zero={"stage": stage}, offload=offload)


def data_with_ignored(micro_batch: int = 4):
    """The test batches, with the first 6 targets of each row left out of the loss (a prompt)."""
    data = batches(micro_batch)
    for _ in range(STEPS):
        x, y = data.next()
        y[:, :6] = IGNORE_INDEX
        yield x, y


def engine_run(model: torch.nn.Module, cfg, loss_of, stage: int) -> tuple[list[float], dict]:
    eng = Engine(model, cfg, total_steps=STEPS)
    losses = []
    for x, y in data_with_ignored():
        loss = loss_of(eng, x, y)
        if stage == 3:
            # The engine releases the root after the first step's forward (no order traced yet)
            # and keeps it after later ones, the next unit to run, while the device budget has
            # room; release it every step, as a short budget would: the loss's backward must
            # then recompute its logits from the head that the engine re-gathers.
            eng.params.release(ROOT_UNIT)
            assert eng.params.state[ROOT_UNIT] is UnitState.SHARDED
            head = model.head if isinstance(model, GPT) else model.get_output_embeddings()
            assert head.weight.untyped_storage().nbytes() == 0, "the head's weight holds no values"
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
    with eng.gathered():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    eng.close()
    return losses, params


def reference_run(model: torch.nn.Module, cfg, logits_of) -> tuple[list[float], dict]:
    """Plain PyTorch AdamW on the plain loss of the whole micro-batch's logits."""
    opt = reference_adamw(model, cfg.optim)
    schedule = reference_schedule(opt, cfg.optim, STEPS)
    losses = []
    for x, y in data_with_ignored():
        loss = F.cross_entropy(logits_of(model, x).float().flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same_training(ours: tuple[list[float], dict], ref: tuple[list[float], dict]) -> None:
    (losses, params), (ref_losses, ref_params) = ours, ref
    print(f"losses {losses} vs {ref_losses}; parameters {rel_diff(params, ref_params):.2e} apart")
    assert all(abs(a - b) <= EXACT * abs(b) for a, b in zip(losses, ref_losses, strict=True))
    assert rel_diff(params, ref_params) <= EXACT


@pytest.mark.parametrize("stage", [2, 3])
def test_the_engine_trains_the_gpt_on_the_chunked_loss_as_on_the_full_one(stage: int, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(loss_module, "CHUNK_TOKENS", 50)
    cfg = engine_config(stage, tmp_path)
    ours = engine_run(tiny_gpt(), cfg, lambda eng, x, y: eng(x, y), stage)
    assert_same_training(ours, reference_run(tiny_gpt(), cfg, lambda model, x: model(x)))


@pytest.mark.parametrize("stage", [2, 3])
def test_the_engine_trains_a_llama_on_the_chunked_loss_as_on_the_full_one(stage: int, tmp_path, monkeypatch) -> None:
    from engine.run.pretrained import causal_lm_loss

    monkeypatch.setattr(loss_module, "CHUNK_TOKENS", 50)
    cfg = engine_config(stage, tmp_path)
    ours = engine_run(llama(), cfg, causal_lm_loss, stage)
    assert_same_training(ours, reference_run(llama(), cfg, lambda model, x: model(input_ids=x).logits))


def test_causal_lm_loss_refuses_a_lora_adapter_on_the_head() -> None:
    from engine.run.pretrained import causal_lm_loss

    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(task_type="CAUSAL_LM", r=4, target_modules=["q_proj", "lm_head"])
    model = peft.get_peft_model(llama(), lora)
    x, y = batches(1).next()
    with pytest.raises(ValueError, match=r"leave the head out of lora\.target_modules"):
        causal_lm_loss(Plain(model), x, y)
