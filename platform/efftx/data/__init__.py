"""Datasets: byte corpora (bytes.py); images come with the DALL-E family."""
