"""Step time: the compiled schedule replayed on a GPU's figures, and what it predicts of a row."""
