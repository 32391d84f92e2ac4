"""Our engine beside plain PyTorch, FSDP2 and DeepSpeed on the same workload: `python -m benchmarks.peers`.

`compare` is the benchmark (and says how to install the peers); `workload` what every
contestant trains; `trainers` each system's step; `rank` one rank's loop; `launch` the
process group of each contestant and its memory, watched from outside.
"""
