"""The front end: what callers talk to. The gRPC GenerationService and AdminService (service.py) on
their server (server.py), bearer-token auth, request validation and resume tags, the router's
Prometheus metrics, and apis/: OpenAI and KServe over HTTP, KServe over gRPC. It imports
router.routing (where a request goes) and router's config and errors; never router.control."""
