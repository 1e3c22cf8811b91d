"""The only package that imports zmq: a blocking client and an asyncio server for the control plane.

Wire frames: client → server ``[seq, header, *payload]``; server → client the same, echoing
``seq`` so that a client can drop a late reply to a request it already gave up on.
"""
