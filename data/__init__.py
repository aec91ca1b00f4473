"""Text to tokens (prepare.py, tokenizer.py) and tokens to batches (tokens.py)."""
