"""Ragged paged attention: reference, TPU and GPU kernels, public op."""
