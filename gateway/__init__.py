"""pagedq's OpenAI-compatible HTTP gateway (docs/gateway.md): ``pagedq gateway``.

FastAPI + uvicorn over the producer's AsyncClient and AsyncBatches. It holds no job state:
everything a request needs (jobs, their events, API keys, rate-limit counters, uploaded
files' records) is in Redis (uploaded files themselves in the batch folder), so any number
of gateway processes may serve behind a load balancer. Imports the wire contract, the clients
and the batch service only: never torch, the engine or the worker (tests/test_architecture.py). Importing this package imports
nothing heavy; ``pagedq.gateway.app`` imports FastAPI.
"""
