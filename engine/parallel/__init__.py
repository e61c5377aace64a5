"""Tensor parallelism: one replica's model split over N processes (see README.md)."""
