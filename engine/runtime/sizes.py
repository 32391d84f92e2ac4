"""Sizes every part of the engine counts in, defined once."""

MIB = 1 << 20
"""Bytes in a mebibyte: the config's ``*_mb`` keys are MiB."""

FP32 = 4
"""Bytes of one fp32 element: masters, moments and gradient shards."""

GIB = 1 << 30
"""Bytes in a gibibyte: what the estimate and disk checks report in."""
