"""Bearer-token checks: every mutating call needs EYRIE_API_TOKEN; reads too unless opened by config."""

from __future__ import annotations

import hmac

from fastapi import HTTPException, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

bearer = HTTPBearer(auto_error=False, description="Authorization: Bearer $EYRIE_API_TOKEN")


def _check(request: Request, credentials: HTTPAuthorizationCredentials | None) -> None:
    token = request.app.state.settings.api_token
    if token is None:
        raise HTTPException(403, "this API has no token configured, so it refuses calls that need one. "
                                 "Fix: set EYRIE_API_TOKEN on the API server (and EYRIE_API_OPEN_READS=true "
                                 "for open reads).")
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise HTTPException(401, "missing bearer token. Fix: send `Authorization: Bearer $EYRIE_API_TOKEN`.",
                            headers={"WWW-Authenticate": "Bearer"})
    if not hmac.compare_digest(credentials.credentials.encode(), token.get_secret_value().encode()):
        raise HTTPException(403, "wrong bearer token. Fix: send the API server's EYRIE_API_TOKEN.")


def need_token(request: Request, credentials: HTTPAuthorizationCredentials | None = Security(bearer)) -> None:
    """Dependency of every mutating route."""
    _check(request, credentials)


def can_read(request: Request, credentials: HTTPAuthorizationCredentials | None = Security(bearer)) -> None:
    """Dependency of every read route: open when EYRIE_API_OPEN_READS=true, else the token."""
    if not request.app.state.settings.api_open_reads:
        _check(request, credentials)
