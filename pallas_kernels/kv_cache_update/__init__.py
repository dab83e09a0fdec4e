"""KV-cache update: reference scatter and per-backend kernels."""
