"""The OpenAI-compatible HTTP API, served by decode and colocated nodes."""
