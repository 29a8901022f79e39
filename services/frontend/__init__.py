"""The OpenAI-compatible HTTP facade."""
