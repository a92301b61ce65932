"""Tools for whoever runs a deployment: the least-privilege ACL file (acl.py, ``pagedq acl``),
a look at the queues and workers (inspection.py, ``pagedq inspect``) and the dead letters
(dlq.py, ``pagedq dlq list|requeue``). Built on the clients (pagedq.producer) and the wire
contract (pagedq.wire); importing this package imports nothing.
"""
