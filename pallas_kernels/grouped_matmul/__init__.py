"""Grouped matmul (the experts of a mixture-of-experts layer): reference, GPU kernel, public op."""
