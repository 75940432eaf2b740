"""The HTTP API (docs/http-api.md): routes, request bodies and their limits, tokens, the OpenAPI
document. It reads the view and writes to the log (``stream.kafka``); it never changes
the view itself."""
