"""The performer attention backend (being written)."""
