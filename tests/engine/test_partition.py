"""How units are cut into shards and chunks: aligned for direct I/O, and padded as little as
the alignment allows, since every step reads and writes the padding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.state.partition import ALIGN_ELEMS, ROOT_UNIT, build_layout, find_units
from tests.training import config, tiny_gpt

MAX_CHUNK = 1 << 18


def layout_of(numel: int, world_size: int):
    params = {"unit": [("w", nn.Parameter(torch.empty(numel), requires_grad=False))]}
    return build_layout(params, world_size, MAX_CHUNK).units[0]


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("numel", [1, 5000, MAX_CHUNK, MAX_CHUNK + 1, 2 * MAX_CHUNK + 7, 9 * MAX_CHUNK - 3])
def test_shards_are_whole_aligned_chunks_with_under_an_alignment_of_padding_each(numel: int, world_size: int) -> None:
    unit = layout_of(numel, world_size)
    chunks = unit.shard_numel // unit.chunk_numel
    assert unit.shard_numel == chunks * unit.chunk_numel and unit.chunk_numel % ALIGN_ELEMS == 0
    assert unit.chunk_numel <= MAX_CHUNK
    assert unit.padded_numel == world_size * unit.shard_numel >= numel
    per_rank = -(-numel // world_size)
    assert chunks == -(-per_rank // MAX_CHUNK), "the fewest chunks the maximum allows"
    assert unit.shard_numel - per_rank < chunks * ALIGN_ELEMS


def test_a_shard_just_over_the_maximum_is_two_half_chunks_not_twice_its_size() -> None:
    unit = layout_of(MAX_CHUNK + ALIGN_ELEMS, world_size=1)
    assert unit.chunk_numel == MAX_CHUNK // 2 + ALIGN_ELEMS
    assert unit.shard_numel == MAX_CHUNK + 2 * ALIGN_ELEMS


GPT_CLASSES = "Block, CausalSelfAttention, Embedding, GPT, LayerNorm, Linear, MLP, ModuleList"


def test_a_unit_class_the_model_lacks_is_refused_naming_the_ones_it_has() -> None:
    """Else it makes no unit, silently, and a resume blames the store for the layout."""
    with pytest.raises(ValueError) as err:
        find_units(tiny_gpt(), ["Block", "Nope"])
    assert str(err.value) == (
        f"zero.unit_classes names 'Nope', which no module of this model is: its module classes are {GPT_CLASSES} "
        "(choose among them, or leave zero.unit_classes empty for every entry of every nn.ModuleList)"
    )
    assert "\n" not in str(err.value)


def test_unit_classes_the_model_has_are_taken() -> None:
    model = tiny_gpt()
    blocks = [name for name, _ in find_units(model, ["Block"]) if name != ROOT_UNIT]
    assert blocks == [f"blocks.{i}" for i in range(len(blocks))] and blocks
    assert [name for name, _ in find_units(model, ["GPT"])] == [ROOT_UNIT], "the model itself: one unit"
    assert len(find_units(model, [])) == len(blocks) + 1


def test_a_unit_class_without_parameters_is_refused() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    with pytest.raises(ValueError, match="names 'ReLU', whose modules hold no parameters: its module classes are "):
        find_units(model, ["ReLU"])


def test_a_long_list_of_module_classes_is_cut_short() -> None:
    kinds = [nn.Linear(2, 2), nn.Conv1d(2, 2, 1), nn.Conv2d(2, 2, 1), nn.Conv3d(2, 2, 1), nn.LayerNorm(2)]
    kinds += [nn.BatchNorm1d(2), nn.GroupNorm(1, 2), nn.Embedding(2, 2), nn.GRU(2, 2), nn.LSTM(2, 2)]
    kinds += [nn.RNN(2, 2), nn.Bilinear(2, 2, 2), nn.PReLU(), nn.ConvTranspose1d(2, 2, 1)]
    with pytest.raises(ValueError) as err:
        find_units(nn.Sequential(*kinds), ["Nope"])
    listed = str(err.value).split("its module classes are ")[1].split(" (choose")[0].split(", ")
    assert len(listed) == 13 and listed[-1] == "..." and listed[:-1] == sorted(listed[:-1])


def test_the_estimate_refuses_a_unit_class_the_model_lacks_too() -> None:
    from engine.tools.estimate import run_shape

    with pytest.raises(ValueError, match=r"zero.unit_classes names 'Nope', which no module of this model is"):
        run_shape(config(zero={"unit_classes": ["Nope"]}), world_size=1)
