"""The tiny local Llama model that tests and the quickstart serve (tokenizer, config, weights, optional training)."""
