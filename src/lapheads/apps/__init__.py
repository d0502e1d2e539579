"""The chat engine (generation with tools, used by the chat evaluations) and the local web chat."""
