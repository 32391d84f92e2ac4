"""How bytes move between tiers: host buffers, asynchronous I/O, the zarr shard store, its
generations and commits, and the shards of units in it. Knows flat tensors and stores, never
the engine; this is its public surface, the one the engine and the benchmarks use."""

from offload.buffers import DIRECT_ALIGN, BufferPool, HostBuffer
from offload.chunks import ChecksumError, FileOps
from offload.generations import CHECKPOINTS, KEEP, CheckpointExistsError, Generations, generation_prefix
from offload.io import IORunner, OffloadIOError
from offload.lock import StoreLock, StoreLockedError, describe_holder, read_holder
from offload.manifest import ManifestError, commit, read_committed
from offload.metadata import FORMAT_VERSION, ArrayInfo
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
)
from offload.store import ShardStore

__all__ = [
    "CHECKPOINTS",
    "DIRECT_ALIGN",
    "FORMAT_VERSION",
    "KEEP",
    "TOP",
    "ArrayInfo",
    "BufferPool",
    "CheckpointExistsError",
    "ChecksumError",
    "ChunkReader",
    "FileOps",
    "Generations",
    "HostBuffer",
    "IORunner",
    "ManifestError",
    "OffloadIOError",
    "Pipeline",
    "PipelineStats",
    "ReadAhead",
    "ShardStore",
    "ShardedUnit",
    "StoreLock",
    "StoreLockedError",
    "array_bytes",
    "array_in_layout",
    "array_name",
    "commit",
    "create_arrays",
    "describe_holder",
    "generation_prefix",
    "read_committed",
    "read_holder",
    "read_shard",
    "read_shard_async",
    "shard_bytes",
    "unit_arrays",
    "write_shard",
    "write_shard_async",
]
