"""The OpenAI-compatible gateway: ``app`` (HTTP, retries, streams), ``routing`` (replica choice and
the weight versions each replica serves, from Temporal), ``nvext`` (request/response translation)."""
