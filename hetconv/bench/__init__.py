"""Benchmarks behind ``hetconv bench``: conv kernels, kernel splits, the protocol codec."""
