"""How bytes move between tiers: host buffers, asynchronous I/O, the zarr shard store, its
generations and commits, and the shards of units in it. Knows flat tensors and stores, never
the engine; this is its public surface, the one the engine and the benchmarks use."""

from offload.buffers import DIRECT_ALIGN, BufferPool, HostBuffer
from offload.chunks import ChecksumError, FileOps
from offload.costs import STAGES, CostAccount, per_gb
from offload.generations import CHECKPOINTS, KEEP, CheckpointExistsError, Generations, generation_prefix
from offload.host_memory import PinningError, alias, host_bytes, pinning_device
from offload.io import IORunner, OffloadIOError
from offload.lock import StoreLock, StoreLockedError, describe_holder, read_holder
from offload.manifest import ManifestError, commit, read_committed
from offload.metadata import FORMAT_VERSION, ArrayInfo, group_attrs
from offload.nodes import SCRATCH
from offload.pipeline import Pipeline, PipelineStats, ReadAhead
from offload.shards import (
    TOP,
    ChunkReader,
    ShardedUnit,
    array_bytes,
    array_in_layout,
    array_name,
    create_arrays,
    read_shard,
    read_shard_async,
    shard_bytes,
    unit_arrays,
    write_shard,
    write_shard_async,
    zero_shard_async,
)
from offload.store import ShardStore
from offload.tuning import CHUNK_RANGE, IOSettings, auto_settings, profile_path

__all__ = [
    "CHECKPOINTS",
    "CHUNK_RANGE",
    "DIRECT_ALIGN",
    "FORMAT_VERSION",
    "KEEP",
    "SCRATCH",
    "STAGES",
    "TOP",
    "ArrayInfo",
    "BufferPool",
    "CheckpointExistsError",
    "ChecksumError",
    "ChunkReader",
    "CostAccount",
    "FileOps",
    "Generations",
    "HostBuffer",
    "IORunner",
    "IOSettings",
    "ManifestError",
    "OffloadIOError",
    "PinningError",
    "Pipeline",
    "PipelineStats",
    "ReadAhead",
    "ShardStore",
    "ShardedUnit",
    "StoreLock",
    "StoreLockedError",
    "alias",
    "array_bytes",
    "array_in_layout",
    "array_name",
    "auto_settings",
    "commit",
    "create_arrays",
    "describe_holder",
    "generation_prefix",
    "group_attrs",
    "host_bytes",
    "per_gb",
    "pinning_device",
    "profile_path",
    "read_committed",
    "read_holder",
    "read_shard",
    "read_shard_async",
    "shard_bytes",
    "unit_arrays",
    "write_shard",
    "write_shard_async",
    "zero_shard_async",
]
