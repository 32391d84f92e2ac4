"""`python -m benchmarks.peers`: see `benchmarks.peers.compare`."""

from benchmarks.peers.compare import main

main()
