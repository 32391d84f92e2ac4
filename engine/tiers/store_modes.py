"""The two ways the nvme optimizer tier writes a step (``store.mode``), as two policies behind
one interface, so the tier itself has no branch on the mode.

``GenerationsMode`` writes each step to the generation after the committed one, so a crash at any
instant leaves the committed step whole, and keeps a checkpoint by renaming a generation
once the next commit supersedes it. ``InPlaceMode`` halves the disk: each step rewrites the one
committed generation, unit by unit; its first write marks the store dirty (durably, on every
rank before its own first write) and the commit clears the mark, so a crash in between is
seen. Nothing supersedes the generation, so a checkpoint is a copy, taken at once.

A store's mode is one of its attributes and may change between runs: a keep still pending
from the generations mode is then taken by copy, and a generation cut for another world size
is replaced, never rewritten (its shards fall elsewhere), by writing a fresh one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from engine.tiers.store_checks import GENERATIONS, IN_PLACE, LIVE_GENERATIONS, check_clean, check_mode
from offload import KEEP, Generations, generation_prefix


class ModeTier(Protocol):
    """What a mode works on of the nvme optimizer tier (``StoreOptimizerState``): its store's
    generations, which of them is committed and which the next step writes, and the tier's own
    ways to create, check and copy a generation."""

    generations: Generations
    committed_generation: int
    target_generation: int
    leader: bool
    barrier: Callable[[], None]

    def create_arrays(self, prefix: str) -> None: ...

    def in_layout(self, prefix: str) -> bool: ...

    def keep_by_copy(self, tag: str, record: dict, retain: int) -> None: ...


class StoreMode(Protocol):
    """How a step's state is written and a checkpoint kept, for ``StoreOptimizerState``."""

    name: str
    live_generations: int
    """Generations on disk besides the checkpoints."""

    def open(self, tier: ModeTier, live: dict | None) -> int:
        """On resume, with ``live`` the committed record (None: checkpoints only): make the next
        step's target ready (the leader's part, every rank calling), and return its number."""
        ...

    def before_write(self, tier: ModeTier) -> None:
        """A unit's new state is about to be written to the target generation."""
        ...

    def after_commit(self, tier: ModeTier, generation: int) -> None:
        """On the leader, once ``generation`` is committed: ready the next target."""
        ...

    def next_target(self, generation: int) -> int:
        """The generation the step after the commit of ``generation`` writes."""
        ...

    def keep(self, tier: ModeTier, tag: str, retain: int) -> None:
        """Keep the committed step as checkpoint ``tag`` (every rank calls it), then apply ``retain``."""
        ...


class GenerationsMode:
    """Each step writes the generation after the committed one (two live generations)."""

    name = GENERATIONS
    live_generations = LIVE_GENERATIONS[GENERATIONS]

    def open(self, tier: ModeTier, live: dict | None) -> int:
        target = tier.committed_generation + 1
        if tier.leader:  # the tier has dropped every uncommitted generation: the target is made afresh
            tier.generations.prepare(target, tier.create_arrays)
        return target

    def before_write(self, tier: ModeTier) -> None:
        return None  # the committed generation is never written

    def after_commit(self, tier: ModeTier, generation: int) -> None:
        tier.generations.prepare(generation + 1, tier.create_arrays)

    def next_target(self, generation: int) -> int:
        return generation + 1

    def keep(self, tier: ModeTier, tag: str, retain: int) -> None:
        """By rename once the next commit supersedes the generation: the request is in
        ``COMMITTED``, so it survives a crash."""
        tier.generations.check_new_tag(tag)  # on every rank, so that all of them raise or none
        tier.barrier()
        if tier.leader:
            tier.generations.keep(tag, retain=retain)
        tier.barrier()


class InPlaceMode:
    """Each step rewrites the committed generation (one live generation), marking the store
    dirty from its first write until the commit."""

    name = IN_PLACE
    live_generations = LIVE_GENERATIONS[IN_PLACE]

    def __init__(self) -> None:
        self._marked = False  # this step has marked the store dirty

    def open(self, tier: ModeTier, live: dict | None) -> int:
        """The committed generation if it is cut for this layout, else (another world size, or
        no live generation) a fresh one, which the commit then makes the only one. A keep still
        pending from the generations mode is taken now, by copy, since no step will supersede
        the generation it names."""
        request = live.get(KEEP) if live else None
        if request:
            if request["tag"] not in tier.generations.checkpoints():  # else a crash came after the copy
                tier.keep_by_copy(request["tag"], tier.generations.own_record(), request["retain"])
            if tier.leader:
                tier.generations.drop_keep_request()
        committed = tier.committed_generation
        in_place = live is not None and tier.in_layout(generation_prefix(committed))
        target = committed if in_place else committed + 1
        if tier.leader:
            tier.generations.drop_uncommitted()  # leftovers: a generations-mode target, a copy cut short
            if not in_place:
                tier.generations.prepare(target, tier.create_arrays)
        return target

    def before_write(self, tier: ModeTier) -> None:
        if tier.target_generation == tier.committed_generation and not self._marked:
            # The first write over the committed generation: from here until the commit a
            # crash leaves it mixing two steps, which the durable mark lets every reader see.
            tier.generations.mark_dirty()
            self._marked = True

    def after_commit(self, tier: ModeTier, generation: int) -> None:
        if generation != tier.committed_generation:
            tier.generations.drop_uncommitted()  # the generation a fresh target replaced

    def next_target(self, generation: int) -> int:
        self._marked = False
        return generation

    def keep(self, tier: ModeTier, tag: str, retain: int) -> None:
        """By a copy now: nothing supersedes the generation."""
        check_clean(tier.generations)  # after a failed step: a copy would keep a mix of two steps
        tier.generations.check_free_tag(tag)  # on every rank, so that all of them raise or none
        tier.keep_by_copy(tag, tier.generations.own_record(), retain)


def store_mode(name: str) -> StoreMode:
    """The policy of ``store.mode = name`` (a fresh one: ``InPlaceMode`` holds a step's mark)."""
    check_mode(name)
    return GenerationsMode() if name == GENERATIONS else InPlaceMode()
