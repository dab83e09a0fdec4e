"""Host-side inputs for vision-language models: decoding untrusted images and preprocessing them."""
