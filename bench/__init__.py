"""Benchmarks. Each prints JSON and measures a peer in the same run; none of them is a test."""
