"""`turbollm serve`: an OpenAI-compatible HTTP server over AsyncLLMEngine (FastAPI + uvicorn).

`app.build_app(engine, args)` builds the FastAPI app; `protocol` holds the request models,
`errors` the OpenAI error bodies, `metrics` the Prometheus metrics, `serving` turns requests
into engine calls and engine outputs into OpenAI responses.
"""
