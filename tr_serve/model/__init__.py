"""The model room: our own compact decoder for the Llama family (fused projections, a rotary
table, masks from positions, KV written through a slot mapping), built from a transformers model's
weights. transformers stays for configs, tokenizers, weight names and as the tests' reference."""
