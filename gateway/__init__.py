"""The OpenAI-compatible gateway: ``app`` (the HTTP app: routes, auth, the error handler),
``proxy`` (an inference request to a vLLM deployment's replicas, with retries), ``dynamo_proxy``
(a dynamo deployment's, through Dynamo's frontend), ``relay`` (the answer side: ``nvext``, the
stream relay), ``attempt`` (a request's bookkeeping), ``upstream`` (the upstream HTTP client and
error answers), ``sse`` (server-sent events), ``routing`` (deployment and replica choice, and the
weight versions each replica serves, from Temporal), ``split`` (the weighted split among
deployments of one model name), ``nvext`` (request/response translation), ``body`` (reading a
request body), ``errors`` (the error answers), ``listing`` (``GET /v1/models``), ``load`` (each
deployment's load and its report), ``dynamo`` / ``dynamo_fields`` (translation for Dynamo's
frontend), ``dynamo_frontend`` (its process), ``dynamo_events`` (the relay of Dynamo's event
plane)."""
