"""Serving engines: vLLM as an engine (stock and faithful), its paged KV read bitwise, its price,
and an OpenAI-compatible server."""
