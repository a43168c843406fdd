"""Models built from the shared layers: the byte/token decoder LM (later: dVAE, DALL-E)."""
