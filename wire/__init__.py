"""The wire contract: everything the worker, the clients, the batch service and the gateway
share, and nothing else. Keys (keys.py), the request, record and event schema (schema.py,
events.py), the server-side scripts (lua/: the ``.lua`` files; scripts.py and
worker_scripts.py: their calls), how to connect (connection.py; which Redis errors no retry
fixes, redis_errors.py), the service settings (settings.py) and the typed errors
(errors.py). The protocol itself, language-neutral, is docs/protocol.md.

It imports none of the packages that use it (tests/test_architecture.py). Importing this
package imports nothing: each module is imported where it is used, so ``pagedq.engine`` may
use a module of it that needs no redis.
"""
