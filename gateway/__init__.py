"""The OpenAI-compatible gateway: ``app`` (HTTP, retries, streams), ``routing`` (deployment and replica
choice, and the weight versions each replica serves, from Temporal), ``split`` (the weighted split
among deployments of one model name), ``nvext`` (request/response translation), ``body`` (reading a
request body), ``errors`` (the error answers)."""
