"""Who may do what: the checks every request passes before its handler runs.

- **Key binding** (with CURVE): a client id is bound to the CURVE key that registered it; a zmq
  request naming it with another key is answered as if the client did not exist (a leaked client
  id is useless to another key holder). Requests over the local socket carry no key: that socket
  takes only the server's own user, who could read its memory anyway.
- **Tenants** (``--tenants``): a caller proves its tenant by its CURVE key or a token
  (:func:`tenant_of`); a client then names only its tenant's models (server.registry) and
  ``cache_salt`` namespaces (:func:`check`). A refusal says what the caller may not use and never
  whether anything is stored there: it comes before any lookup.

The event loop only (as every handler).
"""

from __future__ import annotations

from kvdock.errors import RequestError
from kvdock.protocol import messages as m
from kvdock.protocol.codes import ErrorCode
from kvdock.server.registry import ClientEntry
from kvdock.server.state import ServerState
from kvdock.server.tenants import Tenant


def unknown_client(client_id: str) -> RequestError:
    msg = f"client {client_id!r} is not registered (call RegisterClient first)"
    return RequestError(msg, ErrorCode.UNKNOWN_CLIENT)


def tenant_of(state: ServerState, key: bytes, token: str) -> Tenant | None:
    """The caller's tenant (None when the server has no tenants); UNAUTHORIZED when it has and
    the caller proves none (or a key and a token of two different tenants)."""
    if state.tenants is None:
        return None
    tenant = state.tenants.identify(key, token)
    if tenant is None:
        raise RequestError(
            "this server serves tenants only: connect with a tenant's CURVE key or token (see its tenants file)",
            ErrorCode.UNAUTHORIZED,
        )
    return tenant


def check_model(tenant: Tenant | None, model: str) -> None:
    """UNAUTHORIZED when ``tenant`` may not use ``model``."""
    if tenant is not None and not tenant.allows_model(model):
        raise RequestError(f"tenant {tenant.name!r} may not use model {model!r}", ErrorCode.UNAUTHORIZED)


def check_registrant(state: ServerState, tenant: Tenant | None, model: str) -> None:
    """UNAUTHORIZED unless ``tenant`` may register ``model``: a model it may use that no other
    tenant may (the first layout registered under a name is the one kept: a name two tenants
    share is the admin's to register, so that neither can squat on it for the other)."""
    check_model(tenant, model)
    assert tenant is not None and state.tenants is not None
    others = [t.name for t in state.tenants.all.values() if t is not tenant and t.allows_model(model)]
    if others:
        raise RequestError(
            f"model {model!r} is shared with other tenants: only the admin token may register it",
            ErrorCode.UNAUTHORIZED,
        )


def salts_of(req: m.Request) -> list[str]:
    """The ``cache_salt`` namespaces a request names (none for ops on sessions it opened)."""
    salt = getattr(req, "cache_salt", None)
    if salt is not None:
        return [salt]
    return list(getattr(req, "cache_salts", None) or [])


def check(state: ServerState, req: m.Request, key: bytes) -> ClientEntry | None:
    """Check a request that names a registered client (returned; None when it names none, for
    the handler to refuse): raises UNKNOWN_CLIENT for a client id used with another CURVE key,
    UNAUTHORIZED for a salt that is not its tenant's."""
    client_id = getattr(req, "client_id", None)
    if client_id is None:
        return None
    client = state.registry.clients.get(client_id)
    if client is None:
        return None
    if key and key != client.key:
        raise unknown_client(client_id)
    tenant = client.tenant
    if tenant is not None:
        for salt in salts_of(req):
            if not isinstance(salt, str) or not tenant.allows_salt(salt):
                raise RequestError(
                    f"cache_salt {str(salt)[:64]!r} is not a namespace of tenant {tenant.name!r}",
                    ErrorCode.UNAUTHORIZED,
                )
    return client
