"""Matmul with a weight stored in int8 / float8 and one f32 scale per output channel."""
