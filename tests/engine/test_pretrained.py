"""Fine-tuning a pretrained Hugging Face model: a checkpoint folder (sharded, bf16) is streamed
into a stage-3 store with everything on nvme, unit by unit, into a model built on the meta
device; the exported folder loads with ``from_pretrained``. Nothing is downloaded: the
checkpoints are tiny models built from configs and saved with ``save_pretrained``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from engine.engine import Engine  # noqa: E402
from engine.run import cli  # noqa: E402
from engine.run.pretrained import Pretrained, meta_model, record_source  # noqa: E402
from engine.tiers.optimizer_store import StoreOptimizerState  # noqa: E402
from engine.tools import export as export_module  # noqa: E402
from engine.tools.consolidate import consolidate  # noqa: E402
from engine.tools.export import export  # noqa: E402
from tests.caches import fresh_cache  # noqa: E402
from tests.ranks import run_ranks  # noqa: E402
from tests.training import SEQ_LEN, batches, config, reference_adamw, reference_schedule  # noqa: E402

STEPS = 3
SHARD = "40KB"


def llama(vocab: int = 256) -> transformers.PreTrainedModel:
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ_LEN,
        )
    )  # fmt: skip


def qwen2() -> transformers.PreTrainedModel:
    return transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ_LEN,
            tie_word_embeddings=False,
        )
    )  # fmt: skip


def gpt2() -> transformers.PreTrainedModel:
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=256, n_positions=SEQ_LEN, n_embd=64, n_layer=2, n_head=4, bos_token_id=0,
            eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
        )
    )  # fmt: skip


MODELS = [llama, qwen2, gpt2]
IDS = ["llama", "qwen2", "gpt2-tied"]


def checkpoint(build, folder: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """A pretrained checkpoint as ``save_pretrained`` writes it, in several shards."""
    torch.manual_seed(0)
    build().to(dtype).save_pretrained(folder, max_shard_size=SHARD)
    return folder


def nvme_config(store: Path):
    return config(
        zero={"stage": 3, "prefetch_mb": 1},
        offload={"param": "nvme", "optimizer": "nvme", "nvme_path": str(store)},
    )


def start(folder: Path, store: Path) -> Engine:
    model = meta_model(folder)
    return Engine(model, nvme_config(store), total_steps=STEPS, init_unit=Pretrained(folder, model))


def reference(folder: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("build", MODELS, ids=IDS)
def test_first_logits_equal_from_pretrained(build, tmp_path) -> None:
    folder = checkpoint(build, tmp_path / "pretrained")
    assert len(list(folder.glob("*.safetensors"))) > 1, "the checkpoint is sharded"
    eng = start(folder, tmp_path / "store")
    x = batches(2).next()[0]
    with torch.no_grad():
        ours = eng(input_ids=x).logits
    eng.close()
    with torch.no_grad():
        theirs = reference(folder)(input_ids=x).logits
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("persist", [False, True], ids=["units-freed", "units-kept"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_a_bf16_import_builds_in_bf16_the_values_the_fp32_build_makes(dtype, persist, tmp_path, monkeypatch) -> None:
    """bf16 compute with bf16 masters: a checkpoint's units are built in bf16 straight from its
    tensors (each rounds once either way), equal to what the fp32 build makes from an
    ``init_unit`` that does not say it copies values, and to the checkpoint cast to bf16. Built
    in bf16, a trained unit is made in the optimizer tier's write buffer where one is spare
    (``lend``), and its master written from there with no copy; the parameters, kept or freed until gathered,
    compute the same logits."""
    folder = checkpoint(llama, tmp_path / "pretrained", dtype)
    lent, written = {}, {}
    lend, save_new = StoreOptimizerState.lend, StoreOptimizerState._save_new

    def lend_noted(tier, unit, dtype):
        buffer = lend(tier, unit, dtype)
        lent[unit.name] = None if buffer is None else buffer.data_ptr()
        return buffer

    def save_noted(tier, unit, master):
        written[unit.name] = master.data_ptr()
        save_new(tier, unit, master)

    monkeypatch.setattr(StoreOptimizerState, "lend", lend_noted)
    monkeypatch.setattr(StoreOptimizerState, "_save_new", save_noted)

    def imported(name: str, direct: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        model, built = meta_model(folder), set()
        init = Pretrained(folder, model)

        class Watched:
            """``init``, noting the dtype each unit is built in; copying values only if ``direct``."""

            copies_values = direct

            def __call__(self, params: dict[str, torch.Tensor]) -> None:
                built.update(p.dtype for p in params.values())
                made_at.add(min(p.data_ptr() for p in params.values()))  # the unit's first slot
                init(params)

        store = tmp_path / name
        cfg = config(
            precision={"compute_dtype": "bf16"},
            optim={"master_dtype": "bf16"},
            zero={"stage": 3, "persistence_threshold": 10**9 if persist else 0},
            offload={"param": "nvme", "optimizer": "nvme", "nvme_path": str(store)},
        )
        lent.clear(), written.clear()
        made_at: set[int] = set()
        eng = Engine(model, cfg, total_steps=1, init_unit=Watched())
        with torch.no_grad():
            logits = eng(input_ids=batches(2).next()[0]).logits
        eng.close()
        assert built == {torch.bfloat16 if direct else torch.float32}
        if direct:
            spare = {name: ptr for name, ptr in lent.items() if ptr is not None}
            assert spare, "the first unit at least finds the pool idle"
            assert lent.keys() == written.keys() and spare.items() <= written.items(), "written where lent"
            assert set(spare.values()) <= made_at, "and made there"
        else:
            assert not lent
        consolidate(store, tmp_path / f"{name}.safetensors")
        return load_file(tmp_path / f"{name}.safetensors"), logits

    (direct, direct_logits), (via_fp32, fp32_logits) = imported("direct", True), imported("fp32", False)
    assert torch.equal(direct_logits, fp32_logits)
    expected = params(reference(folder))
    assert direct.keys() == via_fp32.keys() == expected.keys()
    for name, values in direct.items():
        assert torch.equal(values, via_fp32[name]), name
        assert torch.equal(values, expected[name].bfloat16().float()), name


def fine_tune(step) -> list[float]:
    data = batches(4)
    return [step(data.next()[0]) for _ in range(STEPS)]


def torch_adamw(folder: Path, cfg) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same fine-tuning in plain PyTorch, from ``from_pretrained``."""
    model, o = reference(folder), cfg.optim
    opt = reference_adamw(model, o)
    schedule = reference_schedule(opt, o, STEPS)

    def step(x: torch.Tensor) -> float:
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return fine_tune(step), params(model)


@pytest.mark.parametrize("build", MODELS, ids=IDS)
def test_fine_tuned_export_loads_and_equals_torch_adamw(build, tmp_path, monkeypatch) -> None:
    """These models store their parameters under their own names, as the import records, so the
    export builds no model (``test_hub_layouts`` exports those that convert)."""
    folder, store = checkpoint(build, tmp_path / "pretrained"), tmp_path / "store"
    eng = start(folder, store)

    def step(x: torch.Tensor) -> float:
        loss = eng(input_ids=x, labels=x).loss
        eng.backward(loss)
        eng.step()
        return loss.item()

    losses = fine_tune(step)
    with eng.gathered():
        ours = params(eng.module)
    eng.close()
    record_source(folder, store, dtype="bf16")
    assert json.loads((store / "hf" / "source.json").read_text())["converted"] is False
    monkeypatch.setattr(export_module, "rules_model", _no_model)
    files = export(store, tmp_path / "out", max_shard_size=SHARD, dtype="fp32")
    assert len(files) > 1 and (tmp_path / "out" / "model.safetensors.index.json").is_file()
    exported = params(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out"))
    assert exported.keys() == ours.keys()
    for name in ours:
        assert exported[name].dtype == torch.float32
        assert torch.equal(exported[name], ours[name]), f"{name} differs from the engine's"
    ref_losses, ref = torch_adamw(folder, eng.config)
    assert losses == ref_losses and losses[-1] < losses[0]
    for name in ours:
        assert torch.equal(ours[name], ref[name]), f"{name} differs from torch AdamW"


def _no_model(source: Path) -> None:
    raise AssertionError(f"the export built the model of {source} to ask its conversion rules")


def test_a_store_that_does_not_say_whether_its_model_converts_exports_through_the_model(tmp_path, monkeypatch) -> None:
    """A ``source.json`` written before ``converted`` was recorded: the export asks the model."""
    folder, store = checkpoint(llama, tmp_path / "pretrained"), tmp_path / "store"
    start(folder, store).close()
    record_source(folder, store, dtype="bf16")
    record = store / "hf" / "source.json"
    record.write_text(json.dumps({k: v for k, v in json.loads(record.read_text()).items() if k != "converted"}))
    asked = []
    monkeypatch.setattr(export_module, "rules_model", lambda source: asked.append(source) or meta_model(source))
    export(store, tmp_path / "out", max_shard_size=SHARD)
    assert asked == [store / "hf"]
    ours, theirs = (
        params(transformers.AutoModelForCausalLM.from_pretrained(f, dtype="auto")) for f in (tmp_path / "out", folder)
    )
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[n], theirs[n]) for n in ours)


def test_export_defaults_to_the_checkpoints_dtype_and_one_file(tmp_path) -> None:
    folder, store = checkpoint(gpt2, tmp_path / "pretrained"), tmp_path / "store"
    eng = start(folder, store)
    with eng.gathered():
        ours = params(eng.module)
    eng.close()
    record_source(folder, store, dtype=Pretrained(folder, meta_model(folder)).dtype)
    assert export(store, tmp_path / "out") == ["model.safetensors"]
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["dtype"] == "bfloat16" and (tmp_path / "out" / "generation_config.json").is_file()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype="auto")
    assert loaded.lm_head.weight is loaded.transformer.wte.weight, "the tie survives the export"
    for name, param in loaded.named_parameters():
        assert param.dtype == torch.bfloat16 and torch.equal(param, ours[name].bfloat16())
    with pytest.raises(FileExistsError, match="already holds model weights"):
        export(store, tmp_path / "out")


def _damage(folder: Path, how: str) -> str:
    """Spoil the checkpoint in ``folder`` as ``how`` says; the name of the tensor it hits."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.1.mlp.up_proj.weight"
    path = folder / index[name]
    if how in ("truncated", "corrupt"):
        data = path.read_bytes()
        path.write_bytes(data[:-100] if how == "truncated" else data[:8] + b"#" * 16 + data[24:])
        return path.name
    tensors = load_file(path)
    if how == "missing":
        del tensors[name]
    elif how == "integer":
        tensors[name] = tensors[name].to(torch.int8)
    elif how == "unexpected":
        name = "model.layers.1.mlp.extra.weight"
        tensors[name] = torch.zeros(3)
    else:
        tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    return name


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("missing", "lacks tensor"),
        ("unexpected", "has no parameter for"),
        ("misshaped", r"is \[128, 63\], the model's is \[128, 64\]"),
        ("truncated", "is truncated"),
        ("corrupt", "has a corrupt header"),
        ("integer", "is I8, not a float the engine imports"),
    ],
)
def test_bad_checkpoints_are_refused_naming_the_tensor(tmp_path, how: str, message: str) -> None:
    folder = checkpoint(llama, tmp_path / "pretrained")
    name = _damage(folder, how)
    with pytest.raises(ValueError, match=message) as refused:
        start(folder, tmp_path / "store")
    assert name in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "store").exists(), "refused before any work"


def _fine_tune_on_rank(folder: Path, store: Path) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Entry point for ``run_ranks``: the first logits of a model imported on this rank, and its
    weights after a few steps."""
    eng = start(folder, store)
    data = batches(2, eng.comm.rank, eng.comm.world_size)
    with torch.no_grad():
        logits = eng(input_ids=batches(2).next()[0]).logits
    for _ in range(STEPS):
        x = data.next()[0]
        eng.backward(eng(input_ids=x, labels=x).loss)
        eng.step()
    with eng.gathered():
        weights = params(eng.module)
    eng.close()
    return logits, weights


@pytest.mark.slow  # about 12 s; the default run imports, fine-tunes and exports on one rank (test_cli_trains...)
def test_two_ranks_import_fine_tune_and_export(tmp_path) -> None:
    folder, store = checkpoint(llama, tmp_path / "pretrained"), tmp_path / "store"
    ranks = run_ranks(2, _fine_tune_on_rank, folder, store)
    with torch.no_grad():
        theirs = reference(folder)(input_ids=batches(2).next()[0]).logits
    assert all(torch.equal(logits, theirs) for logits, _ in ranks)
    record_source(folder, store, dtype="bf16")
    export(store, tmp_path / "out", dtype="fp32")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for name, param in exported.named_parameters():
        assert all(torch.equal(param, weights[name]) for _, weights in ranks), name


class Table(torch.nn.Module):
    """A module computing a buffer in ``__init__``, from its config if it has one."""

    def __init__(self, config: object = None) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("values", torch.arange(4.0) * (getattr(config, "scale", 1.0)))


class Net(torch.nn.Module):
    def __init__(self, config: object = None) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
        self.table = Table(config)


def test_buffers_are_computed_from_the_modules_config_or_refused_naming_them() -> None:
    from types import SimpleNamespace

    with torch.device("meta"):
        net = Net(SimpleNamespace(scale=2.0))
    eng = Engine(net, config(), init_unit=lambda params: None)
    assert torch.equal(net.table.values, torch.arange(4.0) * 2)
    eng.close()
    with torch.device("meta"):
        unknown = Net()
    with pytest.raises(ValueError, match=r"buffer table.values \(Table\) of a model built on the meta device"):
        Engine(unknown, config(), init_unit=lambda params: None)


def test_a_checkpoint_of_the_base_model_alone_loads_under_the_heads_names(tmp_path) -> None:
    folder = tmp_path / "base"
    torch.manual_seed(0)
    full = gpt2()
    full.transformer.save_pretrained(folder)  # GPT2Model: names without "transformer."
    full.config.save_pretrained(folder)  # the head's architecture
    eng = start(folder, tmp_path / "store")
    with eng.gathered():
        assert all(torch.equal(p, dict(full.named_parameters())[n]) for n, p in eng.module.named_parameters())
    eng.close()


TEXT = "the quick brown fox jumps over the lazy dog, and the dog sleeps on.\n" * 40


def save_tokenizer(folder: Path) -> None:
    """A small byte-level BPE, saved as a Hugging Face tokenizer (nothing downloaded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=alphabet, special_tokens=["<eos>"], show_progress=False
    )
    bpe.train_from_iterator([TEXT], trainer)
    transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>").save_pretrained(folder)


def cli_run(tmp_path: Path, monkeypatch) -> tuple[Path, Path, Path, list[str]]:
    """A bf16 Llama checkpoint with its tokenizer and a text file in ``tmp_path``: its folder,
    the store and export folders, and the ``train`` command line on it (2 steps)."""
    monkeypatch.setenv("XDG_CACHE_HOME", fresh_cache(tmp_path / "cache"))
    folder, store, out = tmp_path / "pretrained", tmp_path / "store", tmp_path / "out"
    torch.manual_seed(0)
    llama(vocab=320).to(torch.bfloat16).save_pretrained(folder, max_shard_size=SHARD)
    save_tokenizer(folder)
    (tmp_path / "corpus.txt").write_text(TEXT)
    train = ["train", "--model.hf", str(folder), "--data.source", str(tmp_path / "corpus.txt"), "--steps", "2"]
    train += ["--seq_len", "16", "--micro_batch", "2", "--nvme_path", str(store)]
    return folder, store, out, train


def test_cli_trains_a_pretrained_model_by_path_and_exports_it(tmp_path, monkeypatch) -> None:
    folder, store, out, train = cli_run(tmp_path, monkeypatch)
    train += ["--stage", "3", "--param", "nvme"]
    train += ["--val_fraction", "0.2", "--eval_every", "1", "--eval_batches", "2"]
    assert cli.main(train) == 0
    assert cli.main(["export", str(store), str(out), "--max-shard-size", SHARD]) == 0
    assert (out / "model.safetensors.index.json").is_file()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    consolidate(store, tmp_path / "masters.safetensors")
    masters = load_file(tmp_path / "masters.safetensors")
    pretrained = load_file(
        folder / json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]["lm_head.weight"]
    )
    for name, param in loaded.named_parameters():
        assert param.dtype == torch.bfloat16 and torch.equal(param, masters[name].bfloat16()), name
    assert not torch.equal(loaded.lm_head.weight, pretrained["lm_head.weight"]), "training changed the weights"
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert (
        tokenizer(TEXT[:60])["input_ids"] == transformers.AutoTokenizer.from_pretrained(folder)(TEXT[:60])["input_ids"]
    )
    assert cli.main(["export", str(tmp_path / "cache"), str(tmp_path / "none")]) == 1, "not a store"


def test_a_vocabulary_over_two_to_the_sixteen_is_kept_as_uint32(tmp_path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    from engine.run.data import load_tokens

    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(70_000)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=words).save_pretrained(tmp_path / "model")
    (tmp_path / "corpus.txt").write_text("w69999 w5\nw65536 w1\n")
    for _ in range(2):  # tokenised, then read back from the cache
        tokens, vocab = load_tokens(
            str(tmp_path / "corpus.txt"), cache_dir=tmp_path, pretrained=str(tmp_path / "model")
        )
        assert vocab == 70_000 and tokens.dtype == np.uint32 and tokens.tolist() == [69999, 5, 65536, 1]


@pytest.mark.parametrize(("optimizer", "param"), [("cpu", "cpu"), ("device", "device")])
def test_a_memory_tier_checkpoint_exports_bit_for_bit(optimizer: str, param: str, tmp_path) -> None:
    """The memory tiers commit no live step: export reads their last checkpoint (or the one named)."""
    folder, store = checkpoint(qwen2, tmp_path / "pretrained"), tmp_path / "store"
    cfg = config(zero={"stage": 3}, offload={"optimizer": optimizer, "param": param, "nvme_path": str(store)})
    model = meta_model(folder)
    eng = Engine(model, cfg, total_steps=STEPS, init_unit=Pretrained(folder, model))
    data = batches(4)
    kept = {}
    for step in range(STEPS):
        x = data.next()[0]
        eng.backward(eng(input_ids=x, labels=x).loss)
        eng.step()
        eng.save(f"step-{step + 1}")
        with eng.gathered():
            kept[step + 1] = params(eng.module)
    eng.close()
    assert not (store / "COMMITTED").exists()
    record_source(folder, store, dtype="bf16")
    export(store, tmp_path / "last", max_shard_size=SHARD, dtype="fp32")
    export(store, tmp_path / "first", dtype="fp32", checkpoint="step-1")
    for out, step in (("last", STEPS), ("first", 1)):
        exported = params(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / out))
        assert exported.keys() == kept[step].keys()
        for name, value in kept[step].items():
            assert torch.equal(exported[name], value), f"{out}: {name} differs from the engine's"
    assert not torch.equal(kept[1]["lm_head.weight"], kept[STEPS]["lm_head.weight"])
    with pytest.raises(FileNotFoundError, match=r"no checkpoint 'step-9' in store .*: it holds step-1, step-2"):
        export(store, tmp_path / "none", checkpoint="step-9")
    with pytest.raises(ValueError, match="pass --generation N or --checkpoint TAG, not both"):
        consolidate(store, tmp_path / "both.safetensors", generation=1, checkpoint="step-1")


def test_cli_exports_a_cpu_tier_run_from_its_checkpoints(tmp_path, monkeypatch) -> None:
    _, store, out, train = cli_run(tmp_path, monkeypatch)
    train += ["--optimizer", "cpu"]
    assert cli.main([*train, "--checkpoint.interval", "1"]) == 0
    assert cli.main(["export", str(store), str(out), "--checkpoint", "step-2"]) == 0
    assert cli.main(["consolidate", str(store), str(tmp_path / "masters.safetensors")]) == 0  # the last: step-2
    masters = load_file(tmp_path / "masters.safetensors")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    for name, param in loaded.named_parameters():
        assert param.dtype == torch.bfloat16 and torch.equal(param, masters[name].bfloat16()), name
    assert (out / "tokenizer.json").is_file()
