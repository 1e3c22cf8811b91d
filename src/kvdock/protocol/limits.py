"""Every limit of the wire protocol, in one place: how large a message, a batch, a name or a
registration may be. Both ends import them from here (the server refuses past them with
``ErrorCode.LIMIT`` or a registration error; the SDK checks or splits before sending).

This module imports nothing (``kvdock.config`` and ``kvdock.layout`` take their bounds from it), so
it can be imported from anywhere without a cycle. The values are part of the wire contract:
raising one is compatible with older peers only where they never send that much.
"""

from __future__ import annotations

# --- requests -----------------------------------------------------------------------------------
DEFAULT_MAX_REQUEST_TOKENS = 2**20  # token ids one request may name (the server's default setting)
MAX_BATCH = 4096  # prompts in one LookupMany / PrepareRetrieveMany (the SDK splits larger batches)
MAX_SALT_LEN = 256  # characters of a cache_salt (it is written into the header of every chunk)
MAX_RENEW = 4096  # sessions per RenewSessions
MAX_REPORTED = 4096  # chunks one FastReads may list (what the SDK's Reporter puts in one)
MAX_REPORTED_READS = 1 << 20  # reads one FastReads may count

# --- registrations ------------------------------------------------------------------------------
MAX_NAME_LEN = 200  # characters of a model name, a fingerprint and each engine string
MAX_VIEW_DIMS = 16  # entries of an engine's view_shape / view_strides
MAX_NUM_LAYERS = 4096  # of a geometry (over all pipeline stages)
MAX_NUM_KV_HEADS = 4096
MAX_HEAD_DIM = 16384
MAX_WORLD_SIZE = 1024  # ranks of a tensor-parallel engine, and pipeline stages
MIN_TOKEN_LEN = 16  # characters of a tenant's token (Describe, RegisterModel, RegisterClient)
MAX_TOKEN_LEN = 1024

# --- framing ------------------------------------------------------------------------------------
MAX_FRAMES = 1 << 16  # frames of one local-channel message
MAX_LOCAL_BODY = (1 << 32) - 1  # bytes of one local-channel message (its length is a u32)
FRAME_SLACK = 1 << 20  # what a message may hold beyond its tokens and chunks (header, names)
BATCH_ENTRY_BYTES = 128  # a batch's per-prompt overhead besides its salt (session id, framing)
DOOR_MAX_REQUEST = 512  # bytes of one request at the pool door
DOOR_MAX_REPLY = 64 << 10  # bytes of the door's reply
DOOR_MAX_FDS = 2  # descriptors the door's reply carries
MAX_SUBSCRIPTION_BYTES = 4096  # a KV events subscription (a topic and a token)


def max_frame_bytes(max_request_tokens: int, pool_bytes: int) -> int:
    """The largest frame a valid zmq request can carry: a chunk (which fits in the pool) or the
    token ids of the largest request, plus slack; the server refuses larger ones before zmq
    buffers them."""
    return max(pool_bytes, 4 * max_request_tokens) + FRAME_SLACK


def max_local_message_bytes(max_request_tokens: int) -> int:
    """The largest message a local (shared-memory) client can send: its token ids and a batch's
    per-prompt salts and session ids, never chunk bytes."""
    return 4 * max_request_tokens + MAX_BATCH * (4 * MAX_SALT_LEN + BATCH_ENTRY_BYTES) + FRAME_SLACK
