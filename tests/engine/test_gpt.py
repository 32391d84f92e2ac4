"""The built-in GPT: sizes, shapes, initialisation and that it learns."""

import math

import pytest
import torch

from engine.run.models.gpt import GPT, Block, GPTConfig, KVCache, init_parameters_

SMALL_PRESETS = ["tiny", "small"]
NOMINAL = {"tiny": 0.24e6, "small": 4.9e6, "medium": 25e6, "large": 125e6, "1b": 1e9, "3b": 3e9}


def tiny(**overrides) -> GPTConfig:
    return GPTConfig.preset("tiny", **overrides)


def batch(config: GPTConfig, size: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (size, config.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def param_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", SMALL_PRESETS)
@pytest.mark.parametrize("tied", [False, True])
def test_num_params_matches_the_built_model(name, tied):
    config = GPTConfig.preset(name, tie_embeddings=tied)
    assert param_count(GPT(config)) == config.num_params()


@pytest.mark.parametrize("name", list(NOMINAL))
def test_presets_have_their_nominal_size(name):
    assert GPTConfig.preset(name).num_params() == pytest.approx(NOMINAL[name], rel=0.1)


def test_num_params_of_a_big_preset_matches_a_meta_build():
    config = GPTConfig.preset("large", vocab_size=8192)
    with torch.device("meta"):
        model = GPT(config)
    assert param_count(model) == config.num_params()


def test_unknown_preset_lists_the_names():
    with pytest.raises(ValueError, match="tiny, small, medium, large, 1b, 3b"):
        GPTConfig.preset("huge")


def test_preset_overrides_replace_fields():
    config = GPTConfig.preset("small", vocab_size=8192, seq_len=128)
    assert (config.vocab_size, config.seq_len, config.d_model) == (8192, 128, 256)


@pytest.mark.parametrize("target", [1e6, 50e6, 1e9])
def test_for_params_is_within_ten_percent(target):
    config = GPTConfig.for_params(target)
    assert config.num_params() == pytest.approx(target, rel=0.1)
    assert config.d_model % 64 == 0 and config.n_head == config.d_model // 64


def test_for_params_holds_overrides_fixed():
    config = GPTConfig.for_params(50e6, vocab_size=8192, n_layer=6, tie_embeddings=True)
    assert (config.vocab_size, config.n_layer, config.tie_embeddings) == (8192, 6, True)
    assert config.num_params() == pytest.approx(50e6, rel=0.1)


def test_for_params_rejects_an_unreachable_size():
    with pytest.raises(ValueError, match="no GPT shape"):
        GPTConfig.for_params(1e3)


def test_config_rejects_heads_that_do_not_divide_the_width():
    with pytest.raises(ValueError, match="divisible by n_head"):
        GPTConfig(d_model=100, n_head=3)


def test_tied_model_shares_the_tensor_and_counts_it_once():
    config = tiny(tie_embeddings=True)
    model = GPT(config)
    assert model.head.weight is model.tok_emb.weight
    assert param_count(model) == config.num_params() == tiny().num_params() - config.vocab_size * config.d_model


def test_forward_shapes_and_loss_at_init():
    config = tiny()
    model = GPT(config)
    x, y = batch(config)
    assert model(x).shape == (4, config.seq_len, config.vocab_size)
    assert model(x[:, :10]).shape == (4, 10, config.vocab_size)
    loss = model(x, y)
    assert loss.shape == () and loss.dtype == torch.float32
    assert abs(loss.item() - math.log(config.vocab_size)) < 0.5


def test_forward_rejects_a_sequence_longer_than_the_config():
    config = tiny()
    with pytest.raises(ValueError, match="seq_len"):
        GPT(config)(torch.zeros(1, config.seq_len + 1, dtype=torch.long))


def test_init_statistics_follow_gpt2():
    config = GPTConfig.preset("tiny", d_model=128, n_head=2)
    model = GPT(config)
    block = model.blocks[0]
    assert block.attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    residual = 0.02 / math.sqrt(2 * config.n_layer)
    assert block.mlp.proj.weight.std().item() == pytest.approx(residual, rel=0.05)
    assert torch.all(block.attn.qkv.bias == 0) and torch.all(block.ln1.weight == 1)


def test_same_seed_same_weights_other_seed_other_weights():
    a, b, c = GPT(tiny(), seed=1), GPT(tiny(), seed=1), GPT(tiny(), seed=2)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=False))
    assert not torch.equal(a.blocks[0].attn.qkv.weight, c.blocks[0].attn.qkv.weight)


@pytest.mark.parametrize("tied", [False, True])
def test_meta_build_initialised_part_by_part_equals_a_normal_build(tied):
    config = tiny(tie_embeddings=tied)
    seed = 1234
    expected = GPT(config, seed=seed)
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device="cpu")
    model.tie_weights()
    params = list(model.named_parameters())
    for name, param in reversed(params):  # one at a time, in another order than reset_parameters
        init_parameters_({name: param}, config, seed)
    assert model.state_dict().keys() == expected.state_dict().keys()
    for name, value in expected.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    assert (model.head.weight is model.tok_emb.weight) == tied


def test_a_block_initialises_alone_the_same_as_inside_the_model():
    config = tiny()
    expected = GPT(config, seed=7).blocks[2]
    block = Block(config)
    init_parameters_({f"blocks.2.{n}": p for n, p in block.named_parameters()}, config, 7)
    assert all(torch.equal(p, q) for p, q in zip(block.parameters(), expected.parameters(), strict=False))


def test_init_rejects_a_foreign_parameter():
    with pytest.raises(ValueError, match="running_mean"):
        init_parameters_({"bn.running_mean": torch.zeros(2)}, tiny(), 0)


def test_adamw_steps_lower_the_loss_on_a_fixed_batch():
    config = tiny()
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, y = batch(config)
    losses = []
    for _ in range(8):
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_forward_backward(dtype):
    config = tiny()
    model = GPT(config).to(dtype)
    x, y = batch(config)
    loss = model(x, y)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    grad = model.blocks[0].attn.qkv.weight.grad
    assert grad.dtype == dtype and torch.isfinite(grad).all()


def test_a_decode_through_the_cache_gives_the_logits_of_the_whole_sequence():
    config = GPTConfig.preset("tiny", seq_len=32)
    model = GPT(config, seed=3)
    ids = torch.randint(0, config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = model(ids)
        cache = KVCache(config)
        # the prompt at once, then one position at a time, then several after a cache (a causal mask of its own)
        pieces = [model(ids[:, :7], cache=cache)]
        pieces += [model(ids[:, i : i + 1], cache=cache) for i in range(7, 16)]
        pieces.append(model(ids[:, 16:], cache=cache))
    assert cache.length == 20
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"input has 33 positions but GPTConfig\.seq_len is 32"):
        model(ids[:, :13], cache=cache)
