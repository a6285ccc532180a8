"""Building blocks of ReaLModel: packed attention, RoPE, norms."""
