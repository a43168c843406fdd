"""Generation as small functions: sampling (sampling.py) and prefill/decode (decode.py)."""
