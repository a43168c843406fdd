"""The sinkhorn attention backend (being written)."""
