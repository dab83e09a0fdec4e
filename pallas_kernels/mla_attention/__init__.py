"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) over a paged latent cache."""
