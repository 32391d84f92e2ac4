"""The training loop of ``python -m engine train``: built-in model and data, a plain loop.

The loop is the one a user writes by hand (forward, ``backward``, ``step``); this file
only adds what a long run wants around it: a progress bar, a log line every few steps
(loss, tokens/s, peak host RSS, bytes per tier), per-step records in ``train.metrics``
for whoever tunes the tiers, a checkpoint every ``checkpoint.interval``
steps (and of the last step where the optimizer state is in memory, so that every run leaves
something to export), a clean stop on SIGINT/SIGTERM that finishes the step in flight, and a stop before
the commit of a step whose loss is not finite (``DivergedError``, as the engine raises for
gradients).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import logging
import math
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from engine.config import Config
from engine.engine import Engine
from engine.run.data import TokenBatches, load_tokens, split
from engine.run.evaluate import Validation, perplexity
from engine.run.examples import ExampleBatches
from engine.run.lora import lora_model
from engine.run.loss import IGNORE_INDEX
from engine.run.models.gpt import GPT, GPTConfig, init_parameters_
from engine.run.pretrained import (
    causal_lm_loss,
    check_vocabulary,
    pretrained_model,
    recorded_folder,
    source_keeper,
)
from engine.run.records import is_records
from engine.run.sft import RecordData, record_data
from engine.run.watch import Scalars, step_record
from engine.runtime.comm import node_of_env
from engine.runtime.rss import peak_rss_bytes
from engine.runtime.sizes import GIB, MIB
from engine.tiers import hosts
from engine.tiers.store_checks import resume_point
from offload import CheckpointExistsError, read_committed

logger = logging.getLogger(__name__)

LossFn = Callable[[Engine, torch.Tensor, torch.Tensor], torch.Tensor]
"""The loss of one micro-batch ``(x, y)``, computed through the engine's forward."""


@dataclass
class TrainResult:
    """What a run did: per-step losses and how it ended."""

    losses: list[float] = field(default_factory=list)
    steps_done: int = 0
    stopped_early: bool = False
    seconds_per_step: float = 0.0
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    """``(step, validation loss)`` of each evaluation."""


def build_model(config: Config, vocab_size: int) -> GPT:
    """The built-in GPT sized by ``model.params`` (if set) or ``model.preset``."""
    shape = dict(vocab_size=vocab_size, seq_len=config.data.seq_len, tie_embeddings=config.model.tie_embeddings)
    gpt_config = (
        GPTConfig.for_params(config.model.params, **shape)
        if config.model.params > 0
        else GPTConfig.preset(config.model.preset, **shape)
    )
    return GPT(gpt_config, seed=config.train.seed)


def meta_model(config: Config, vocab_size: int) -> tuple[GPT, Callable[[dict[str, torch.Tensor]], None]]:
    """``build_model`` on the ``meta`` device, and the ``init_unit`` with which ``Engine``
    materialises and initialises it unit by unit: the model never exists whole in memory."""
    with torch.device("meta"):
        model = build_model(config, vocab_size)
    return model, functools.partial(init_parameters_, config=model.config, seed=config.train.seed)


def resumable(config: Config, overwrite: bool = False) -> bool:
    """A run continues where the store at ``offload.nvme_path`` last committed, if there is one
    and ``overwrite`` does not replace it (the memory tiers commit no steps there, only
    checkpoints, resumed from by tag)."""
    return not overwrite and config.offload.optimizer_in_store and resume_point(own_store(config))[0]


def own_store(config: Config) -> Path:
    """The store of the host this process runs on (``offload.nvme_path`` with its ``{node}``)."""
    return Path(config.offload.on_node(node_of_env()).store_path)


def full_folder(err: BaseException, folders: list[Path]) -> Path:
    """Which of a store's folders a full-disk error is about: the one its messages (or those
    of its causes) name a file in (the others first: the store's messages name its own); the
    first where none is named."""
    told: list[str] = []
    seen: BaseException | None = err
    while seen is not None and len(told) < 16:
        told += [str(seen), str(getattr(seen, "filename", "") or "")]
        seen = seen.__cause__ or seen.__context__
    for folder in [*folders[1:], folders[0]]:
        absolute = os.path.abspath(folder)
        if any(f"{folder}/" in text or f"{absolute}/" in text for text in told):
            return folder
    return folders[0]


def save_checkpoint(engine: Engine, tag: str) -> None:
    """``Engine.save``, except that a tag an earlier run kept is left as it is, with a warning,
    rather than stopping the run: a run resumed from an older checkpoint passes the same step
    numbers again."""
    try:
        engine.save(tag)
    except CheckpointExistsError as err:
        logger.warning("%s; this run does not keep it again", err)


def save_final(engine: Engine, interval: int) -> None:
    """Keep the last step as checkpoint ``step-<n>`` where the state is in memory (the memory
    tiers commit nothing to the store by themselves), unless ``checkpoint.interval`` just kept
    it: every run, finished or stopped, leaves a state that ``export`` and ``consolidate`` read.
    A tag an earlier run kept (a run resumed from an older checkpoint) is never replaced: the
    step is kept as ``step-<n>.<k>``, the first free. Made durable when the engine closes."""
    step = engine.global_step
    if interval and step % interval == 0:
        return
    for tag in (f"step-{step}", *(f"step-{step}.{k}" for k in range(1, 1000))):
        try:
            engine.save(tag)
        except CheckpointExistsError:
            continue
        if engine.comm.rank == 0:
            logger.info("keeping the last step as checkpoint %s in %s", tag, engine.config.offload.store_path)
        return


class StopFlag:
    """Set by SIGINT/SIGTERM so the loop ends after the step in flight, never inside it."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopFlag:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame) -> None:
        if self.requested:  # a second Ctrl-C means now
            raise KeyboardInterrupt
        self.requested = True
        logger.warning("%s received: stopping after the step in flight", signal.Signals(signum).name)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def train(config: Config, checkpoint: str | None = None, overwrite: bool = False) -> TrainResult:
    """Train the built-in model on the built-in (or configured) data for ``train.steps`` steps,
    from the store's last committed step if it has one, or from its checkpoint ``checkpoint``,
    or afresh, replacing whatever the store holds, with ``overwrite``.
    A full disk stops the run naming the store, what it still holds and what to do."""
    try:
        return _train(config, checkpoint, overwrite)
    except OSError as err:
        if err.errno != errno.ENOSPC:
            raise
        path = own_store(config)
        try:
            record = read_committed(path)
        except ValueError:
            record = None
        holds = f"it still holds step {record.get('step')}" if record else "it holds no committed step yet"
        folders = [Path(p) for p in config.offload.on_node(node_of_env()).nvme_paths]
        full = full_folder(err, folders)
        where = full if full == folders[0] else f"{full} (folder {folders.index(full) + 1} of store {path})"
        raise OSError(
            errno.ENOSPC,
            f"the disk of {where} is full ({err}): free space there, or set offload.nvme_path to a larger disk "
            f'(store.mode = "in-place" needs half the space); {holds}, and the same command continues from it',
        ) from err


def start_engine(
    config: Config,
    model: nn.Module,
    init: Callable[[dict[str, torch.Tensor]], None],
    checkpoint: str | None,
    overwrite: bool = False,
) -> Engine:
    """The engine of a new run (replacing the store's content with ``overwrite``), or of one
    continued from its store (``resume_point``) or from its checkpoint ``checkpoint``."""
    if overwrite and checkpoint is not None:
        raise ValueError("--overwrite starts afresh and --from-checkpoint continues a checkpoint: pass one of them")
    resume = checkpoint is not None
    if checkpoint is None and config.offload.optimizer_in_store and not overwrite:
        resume, checkpoint = resume_point(own_store(config))
        if config.offload.node_local:  # one host's store missing is refused on resume, not started afresh
            resume, checkpoint = hosts.any_resumes(resume, checkpoint)
        if checkpoint is not None:
            logger.warning(
                '%s was stopped mid-step while rewritten in place (store.mode = "in-place"): resuming from its last '
                "checkpoint, %s; the steps after it are taken again",
                config.offload.store_path,
                checkpoint,
            )
    if resume:
        return Engine.resume(model, config, checkpoint=checkpoint)
    return Engine(model, config, init_unit=init, overwrite=overwrite)


def train_step(
    engine: Engine, data: TokenBatches | ExampleBatches, accum: int, loss_of: LossFn = Engine.__call__
) -> float:
    """One optimizer step over ``accum`` micro-batches; the loss averaged over them and the ranks
    (of fine-tuning records: over every counted token of the step, ``token_weights``). A loss
    that is not finite stops the step before it can be committed."""
    batches = [data.next() for _ in range(accum)]
    loss_sum = 0.0
    weights = token_weights(engine, batches) if isinstance(data, ExampleBatches) else [1.0] * accum
    for batch, weight in zip(batches, weights, strict=True):
        loss = loss_of(engine, *batch)
        if weight != 1.0:
            loss = loss * weight
        engine.backward(loss)
        loss_sum += loss.item()
    loss_value = engine.comm.all_reduce_value(loss_sum / accum) / engine.comm.world_size
    if not math.isfinite(loss_value):
        engine.abandon_step(f"the loss is {loss_value}")
    engine.client_state = {"data": data.state_dict()}
    engine.step()
    return loss_value


def token_weights(engine: Engine, batches: Sequence[tuple[torch.Tensor, ...]]) -> list[float]:
    """What each micro-batch's mean loss is weighed by so that the step's loss, averaged over
    micro-batches and ranks as the engine averages gradients, is the mean over every counted
    token of the step (fine-tuning rows count different numbers of tokens): the same at any
    world size and accumulation (on one rank without accumulation, a weight of exactly 1).
    Every rank calls it: the count is summed over them."""
    counts = [int((batch[1] != IGNORE_INDEX).sum()) for batch in batches]
    total = engine.comm.all_reduce_value(float(sum(counts)))
    share = len(batches) * engine.comm.world_size / max(total, 1.0)
    return [count * share for count in counts]


def micro_batch_for(config: Config, saved: dict[str, Any] | None, world: int) -> int:
    """The per-rank micro-batch: a run resumed on another number of ranks keeps its global batch,
    so the same rows make each step (and the loss curve goes on), whatever ``data.micro_batch`` says."""
    saved_world = (saved or {}).get("world_size")
    global_batch = (saved or {}).get("global_batch")
    if saved_world in (None, world) or not isinstance(global_batch, int) or global_batch < 1:
        return config.data.micro_batch  # same ranks, or a state the batches themselves will refuse
    if global_batch % world:
        raise ValueError(
            f"the run was saved with a global batch of {global_batch} rows on {saved_world} rank(s), which "
            f"{world} ranks cannot share evenly: resume on a number of ranks that divides {global_batch}"
        )
    logger.info(
        "resuming a %s-rank run on %d rank(s): keeping its global batch of %d rows, data.micro_batch %d per rank",
        saved_world,
        world,
        global_batch,
        global_batch // world,
    )
    return global_batch // world


def log_step(engine: Engine, step: int, loss: float, tokens_per_s: float, fractions: dict[str, float]) -> None:
    """The log line of a step; ``fractions``: of a fine-tuning step's positions, those in the loss and padding."""
    tiers = engine.memory_report()
    shares = (
        f" | {fractions['loss_token_fraction']:.0%} in the loss, {fractions['padding_fraction']:.0%} padding"
        if fractions
        else ""
    )
    logger.info(
        "step %d loss %.4f | %.0f tokens/s%s | peak RSS %.2f GiB | device %.1f MiB, cpu %.1f MiB, nvme %.1f MiB",
        step,
        loss,
        tokens_per_s,
        shares,
        peak_rss_bytes() / GIB,
        tiers["device"] / MIB,
        tiers["cpu"] / MIB,
        tiers["nvme"] / MIB,
    )


Corpus = np.ndarray | RecordData
"""What a run trains on: a token corpus (random windows) or fine-tuning records (whole examples)."""


def run_model(
    config: Config, records: RecordData | None = None, recorded: bool = False
) -> tuple[Corpus, nn.Module, Callable[[dict[str, torch.Tensor]], None], LossFn]:
    """The data, the model to train on the meta device, its ``init_unit`` and the loss of a
    batch with it: the built-in GPT, or the pretrained model at ``model.hf`` (with LoRA adapters
    if ``lora.r``), which is checked against its checkpoint before the corpus is tokenised (or
    against the tokenizer of ``records``, already tokenised)."""
    data = config.data
    if not config.model.hf:
        tokens, vocab_size = load_tokens(data.source, data.tokenizer, vocab_size=data.vocab_size)
        model, init = meta_model(config, vocab_size)
        return tokens, model, init, Engine.__call__
    pretrained, init = pretrained_model(config.model.hf, data.seq_len, recorded)
    corpus: Corpus
    if records is None:
        corpus, vocab_size = load_tokens(data.source, data.tokenizer, pretrained=config.model.hf)
    else:
        corpus, vocab_size = records, records.vocab_size
    check_vocabulary(pretrained, vocab_size, config.model.hf)
    if config.lora.r:
        return corpus, *lora_model(pretrained, init, config.lora, config.train.seed), causal_lm_loss
    return corpus, pretrained, init, causal_lm_loss


def fine_tuning_records(config: Config) -> tuple[Config, RecordData | None]:
    """The records a fine-tuning run trains on (None: a token corpus), and the config with the
    steps its ``train.epochs`` take."""
    if is_records(config.data.source):
        records = record_data(config)
        return records.with_steps(config), records
    if config.train.epochs:
        raise ValueError(
            f"train.epochs = {config.train.epochs} counts passes over fine-tuning records, but data.source = "
            f"{config.data.source!r} is a corpus drawn as random windows: set train.steps instead"
        )
    return config, None


def batches_for(config: Config, corpus: Corpus, engine: Engine) -> TokenBatches | ExampleBatches:
    """This rank's training batches, continuing where the run's committed step left them."""
    saved = engine.client_state.get("data")
    rank, world = engine.comm.rank, engine.comm.world_size
    micro_batch = micro_batch_for(config, saved, world)
    data: TokenBatches | ExampleBatches
    if isinstance(corpus, RecordData):
        data = corpus.batches(config, rank, world, micro_batch)
    else:
        data = TokenBatches(
            corpus,
            seq_len=config.data.seq_len,
            micro_batch=micro_batch,
            rank=rank,
            world_size=world,
            seed=config.data.seed,
        )
    if saved is not None:
        data.load_state_dict(saved)
    return data


def finished_at(config: Config, checkpoint: str | None, overwrite: bool) -> int | None:
    """The step at or past ``train.steps`` that the store this run continues has committed, read
    before anything is built or changed (a giant model takes minutes to build, for nothing),
    else None. Only for a store all ranks share: each host's own might be a step apart."""
    if checkpoint is not None or overwrite or config.offload.node_local or not config.offload.optimizer_in_store:
        return None
    store = own_store(config)
    if resume_point(store) != (True, None):
        return None
    step = (read_committed(store) or {}).get("step")
    return step if isinstance(step, int) and step >= config.train.steps else None


def say_nothing_to_do(step: int, steps: int) -> None:
    logger.warning(
        "already at step %d of %d: nothing to do; raise train.steps to continue (e.g. --steps %d)",
        step,
        steps,
        2 * steps,
    )


def _train(config: Config, checkpoint: str | None, overwrite: bool) -> TrainResult:
    recorded = recorded_folder(own_store(config)) if config.model.hf and not checkpoint else None
    if recorded and resumable(config, overwrite):  # the source checkpoint may be gone: not read again
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, hf=recorded))
    config, records = fine_tuning_records(config)
    done = finished_at(config, checkpoint, overwrite)
    if done is not None:
        if int(os.environ.get("RANK", "0")) == 0:
            say_nothing_to_do(done, config.train.steps)
        return TrainResult(steps_done=done)
    from_record = bool(config.model.hf) and config.model.hf == recorded
    corpus, model, init, loss_of = run_model(config, records, recorded=from_record)
    validation = None
    if config.data.val_fraction > 0:
        if isinstance(corpus, np.ndarray):  # records hold their examples out themselves
            corpus, held_out = split(corpus, config.data.val_fraction)
        every = config.train.eval_every or config.train.steps
        validation = Validation(
            held_out if isinstance(corpus, np.ndarray) else functools.partial(corpus.batches, config, held_out=True),
            config.data.seq_len,
            config.data.micro_batch,
            config.train.eval_batches,
            every,
            loss_of,
        )
    engine = start_engine(config, model, init, checkpoint, overwrite)
    dtype = getattr(init, "dtype", "fp32")  # a pretrained model's, to export in
    keep_source = source_keeper(config, dtype) if engine.comm.rank == 0 and not from_record else lambda: None
    return _run_steps(config, engine, batches_for(config, corpus, engine), validation, loss_of, keep_source)


def _run_steps(
    config: Config,
    engine: Engine,
    data: TokenBatches | ExampleBatches,
    validation: Validation | None,
    loss_of: LossFn,
    keep_source: Callable[[], None],
) -> TrainResult:
    rank = engine.comm.rank
    tokens_per_step = data.global_batch * config.data.seq_len * config.zero.grad_accum_steps
    result = TrainResult()
    if engine.global_step >= config.train.steps and rank == 0:
        say_nothing_to_do(engine.global_step, config.train.steps)
    progress = tqdm(total=config.train.steps, initial=engine.global_step, desc="train", unit="step", disable=rank != 0)
    window_start, window_steps = time.perf_counter(), 0
    run_start = window_start
    scalars = Scalars(config.train.metrics, config.train.tensorboard) if rank == 0 else Scalars("", "")
    # Also when a step fails, the engine's I/O and process group are released, the scalars
    # flushed, and the progress bar ends its line before the error is logged.
    with StopFlag() as stop, logging_redirect_tqdm(), contextlib.closing(engine), contextlib.closing(scalars), progress:
        for step in range(engine.global_step, config.train.steps):
            loss_value = train_step(engine, data, config.zero.grad_accum_steps, loss_of)
            result.losses.append(loss_value)
            result.steps_done = step + 1
            val_loss = None
            if validation and validation.due(result.steps_done, config.train.steps):
                val_loss = validation.loss(engine, config.data.seed)
                result.val_losses.append((result.steps_done, val_loss))
            fractions = data.take_fractions() if isinstance(data, ExampleBatches) else {}
            scalars.write(step_record(engine, loss_value, val_loss, tokens_per_step, peak_rss_bytes()) | fractions)
            window_steps += 1
            progress.update(1)
            progress.set_postfix(loss=f"{loss_value:.3f}", **({"val": f"{val_loss:.3f}"} if val_loss else {}))
            if rank == 0 and (
                result.steps_done % config.train.log_every == 0 or result.steps_done == config.train.steps
            ):
                tokens_per_s = tokens_per_step * window_steps / (time.perf_counter() - window_start)
                log_step(engine, result.steps_done, loss_value, tokens_per_s, fractions)
                window_start, window_steps = time.perf_counter(), 0
            if rank == 0 and val_loss is not None:
                logger.info("step %d validation loss %.4f, perplexity %.2f", step + 1, val_loss, perplexity(val_loss))
            interval = config.checkpoint.interval
            if interval and engine.global_step % interval == 0:
                save_checkpoint(engine, f"step-{engine.global_step}")
                keep_source()
            if stop.requested:
                result.stopped_early = True
                break
        if result.losses and not config.offload.optimizer_in_store:
            save_final(engine, config.checkpoint.interval)
    result.seconds_per_step = (time.perf_counter() - run_start) / max(1, len(result.losses))
    if result.stopped_early and rank == 0:
        how = (
            f"run the same command again to resume from {engine.config.offload.store_path}"
            if config.offload.optimizer_in_store
            else f"resume with --from-checkpoint step-{result.steps_done}"
        )
        logger.warning("stopped after step %d of %d: %s", result.steps_done, config.train.steps, how)
    return result
