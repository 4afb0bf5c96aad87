"""Building blocks of the models: parallel linears, norms, RoPE, activations, embeddings, attention."""
