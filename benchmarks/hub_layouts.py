"""Every causal LM whose checkpoints transformers converts on load, imported by the engine.

For each model type that has a ``AutoModelForCausalLM`` class and conversion rules of its own
(``transformers.conversion_mapping``: renamed keys, experts stored one tensor per expert), a
tiny model is built from its default config shrunk to a few layers of width 64, saved by
``save_pretrained`` in several shards, and read back unit by unit through the engine's
importer (``engine.run.pretrained.Pretrained``); every parameter must equal what
``from_pretrained`` loads. Types whose shrunk model is still over 50M parameters (multimodal
towers that keep their own sizes) are skipped; a config that transformers itself cannot build
at the small sizes is reported as such.

    python -m benchmarks.hub_layouts [--only mixtral qwen2_moe]
"""

from __future__ import annotations

import logging
import tempfile
import warnings
from typing import Any

import torch

from benchmarks.report import base_parser, print_table, save_json, setup_logging

SMALL = {
    "vocab_size": 256, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 64, "num_hidden_layers": 2, "intermediate_size": 96, "moe_intermediate_size": 48,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "head_dim": 16,
    "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
}  # fmt: skip
MAX_PARAMS = 5e7


def converted_kinds() -> list[str]:
    """The causal LM model types with conversion rules (their own, or another family's)."""
    from transformers.conversion_mapping import _MODEL_TO_CONVERSION_PATTERN, get_checkpoint_conversion_mapping
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    def converted(kind: str) -> bool:
        return kind in _MODEL_TO_CONVERSION_PATTERN or get_checkpoint_conversion_mapping(kind) is not None

    return sorted(kind for kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if converted(kind))


def small_config(kind: str) -> Any:
    """The default config of ``kind`` with ``SMALL``'s sizes where it has those keys."""
    import transformers

    given = {k: v for k, v in SMALL.items() if hasattr(transformers.AutoConfig.for_model(kind), k)}
    settings = transformers.AutoConfig.for_model(kind, **given)
    layers = getattr(settings, "layer_types", None)
    if isinstance(layers, list) and len(layers) != settings.num_hidden_layers:
        settings.layer_types = layers[: settings.num_hidden_layers]
    if (getattr(settings, "pad_token_id", None) or 0) >= SMALL["vocab_size"]:  # an id of the full vocabulary
        settings.pad_token_id = 0
    return settings


def imports_as_transformers_loads(kind: str) -> str:
    """``ok``, or why not: the engine's import of a tiny ``kind`` against ``from_pretrained``."""
    import transformers

    try:
        settings = small_config(kind)
        with torch.device("meta"):
            count = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(settings).parameters())
        if count > MAX_PARAMS:
            return f"skipped: {count / 1e6:.0f}M parameters at the small sizes"
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(settings)
    except Exception as err:  # transformers cannot build it small: reported, not the engine's
        return f"not built by transformers at the small sizes: {type(err).__name__}: {err}"[:200]
    with tempfile.TemporaryDirectory() as folder:
        try:
            model.save_pretrained(folder, max_shard_size="200KB")
            loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        except Exception as err:  # transformers cannot save or load it small: reported, not the engine's
            return f"not saved or loaded by transformers at the small sizes: {type(err).__name__}: {err}"[:200]
        return _compare(folder, dict(loaded.named_parameters()))


def _compare(folder: str, loaded: dict[str, torch.Tensor]) -> str:
    """``ok`` if every parameter the engine imports from ``folder`` equals ``loaded``'s."""
    from engine.run.pretrained import Pretrained, meta_model
    from engine.state.partition import find_units, unit_parameters

    built = meta_model(folder)
    try:
        init = Pretrained(folder, built)
    except ValueError as err:
        return f"refused by the engine: {err}"[:200]
    for params in unit_parameters(built, find_units(built)).values():
        values = {name: torch.empty(p.shape) for name, p in params}
        init(values)
        differ = [name for name, v in values.items() if not torch.equal(v, loaded[name].detach())]
        if differ:
            return f"differs from from_pretrained: {differ[0]}"
    return "ok"


def main(argv: list[str] | None = None) -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="model types to run (default: every one with conversion rules)")
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    rows = [
        {"model type": kind, "import": imports_as_transformers_loads(kind)} for kind in args.only or converted_kinds()
    ]
    print_table("the engine's import of each converted causal LM, against from_pretrained", rows)
    imported = sum(r["import"] == "ok" for r in rows)
    print(f"{imported} of {len(rows)} import as from_pretrained loads them")
    save_json(args.out, "hub_layouts", {"rows": rows, "imported": imported})


if __name__ == "__main__":
    main()
