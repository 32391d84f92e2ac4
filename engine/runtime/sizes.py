"""Sizes every part of the engine counts in, defined once."""

MIB = 1 << 20
"""Bytes in a mebibyte: the config's ``*_mb`` keys are MiB."""

FP32 = 4
"""Bytes of one fp32 element: masters, moments and gradient shards."""
