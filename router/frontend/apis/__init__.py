"""HTTP and KServe front ends of a router replica.

Every front end turns its protocol's request into a ``splitserve.v1.GenerateRequest`` and runs
it through the same ``GenerationService.generate`` the gRPC ``Generate`` uses (admission,
routing, tenant salt, migration, metrics, cancellation), in process: no loopback gRPC hop.

Reading order:

- ``errors.py``      APIError, and how a CallRejected becomes an HTTP status and an error body
- ``openai_schema.py``  OpenAI request bodies -> GenerateRequest (pure; names the bad field)
- ``openai_api.py``  /v1/models, /v1/completions, /v1/chat/completions (JSON and SSE)
- ``tensors.py``     KServe v2 tensors: BYTES/BOOL codecs, the vLLM-backend LLM convention
- ``kserve_http.py`` /v2/... over HTTP, and Triton's /generate and /generate_stream
- ``kserve_grpc.py`` inference.GRPCInferenceService on the router's gRPC port
- ``streaming.py``   SSE framing, and cancelling a call when its HTTP client goes away
- ``app.py``         the FastAPI app (auth, health, metrics) and the uvicorn server in the actor's loop
"""
