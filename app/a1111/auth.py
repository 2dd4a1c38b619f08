"""Who may use the A1111 API, and when it is served at all.

A1111 protects its API with HTTP basic auth (`--api-auth user:pass`), which is what its clients
send (Open WebUI's "API Auth String", SillyTavern's and `webuiapi`'s user and password). Here:

- `--api-auth` given: those logins, and only those, open the API;
- otherwise, when the UI requires a login (`--auth`, or the password generated for `--share` /
  `--listen`): the same logins;
- otherwise the app is on loopback without a login, and so is the API.

The API is served whenever a login protects it or the app is on loopback. An app reachable by
others without any login (`--listen`/`--share` with `--no-auth`) serves it only with `--api`,
because it can load checkpoints and fill the disk with images.

The check runs in the request guard (`app.ui.guard`), before the body is read: a client that has
not logged in cannot make the server buffer or parse anything (16 parallel 20 MiB bodies took the
server from 2.4 to 9.3 GiB when FastAPI parsed them before its login dependency ran). Failed logins
are throttled per address like the UI's (`LoginThrottle`), and a request a browser made for another
site's page (`guard.cross_site`, any method) is refused: a web page the user visits must not be
able to interrupt or unload through a loopback API that has no login. API clients are servers and
scripts, which send no such headers.
"""

from __future__ import annotations

import base64
import binascii
import secrets
import time
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers

from app.a1111.errors import ApiError, error_response
from app.settings import Settings
from app.ui.guard import cross_site
from app.ui.login_throttle import LoginThrottle

CHALLENGE = {"WWW-Authenticate": 'Basic realm="Steady Diffusion API"'}


def api_enabled(settings: Settings, ui_logins: tuple[tuple[str, str], ...]) -> bool:
    """Served on loopback, behind a login, or when asked for with `--api` (see the module docstring)."""
    exposed = settings.listen or settings.share
    return settings.api or bool(settings.api_auth or ui_logins) or not exposed


def api_logins(settings: Settings, ui_logins: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """`--api-auth` when given, else the UI's logins (possibly none)."""
    return tuple(settings.api_auth) or tuple(ui_logins)


@dataclass(eq=False)
class BasicAuth:
    """The API's login (HTTP basic credentials), checked by the request guard; with no logins it lets
    everyone in but cross-site pages."""

    logins: tuple[tuple[str, str], ...]
    throttle: LoginThrottle = field(default_factory=LoginThrottle)

    def __call__(self, scope: dict) -> JSONResponse | None:
        """The guard's gate: None to let the request on, else the refusal in A1111's error shape."""
        try:
            self.check(Headers(scope=scope), (scope.get("client") or ("unknown",))[0])
        except ApiError as exc:
            return error_response(exc.status_code, "HTTPException", exc.detail, f"{exc.status_code}: {exc.detail}",
                                  exc.headers)
        return None

    def check(self, headers: Headers, client: str) -> None:
        """Raise `ApiError` (403 cross-site, 401, 429 throttled) unless the request may use the API."""
        if cross_site(headers):
            raise ApiError(403, "cross-site requests from a web page are refused; call the API from a server or "
                                "script")
        if not self.logins:
            return
        offered = _credentials(headers.get("authorization", ""))
        if offered is None:
            raise ApiError(401, "Not authenticated: send HTTP basic auth (the API's user and password)", CHALLENGE)
        wait = self.throttle.begin(client, time.monotonic())
        if wait > 0:
            raise ApiError(429, f"too many failed logins from {client}; try again in {wait:.0f} s",
                           {"Retry-After": str(int(wait) + 1)})
        if not self._known(*offered):
            raise ApiError(401, "Incorrect username or password", CHALLENGE)
        self.throttle.succeeded(client)

    def _known(self, user: str, password: str) -> bool:
        """Compares against every login, in constant time per login, so timing tells nothing."""
        found = False
        for known_user, known_password in self.logins:
            same_user = secrets.compare_digest(user.encode(), known_user.encode())
            same_password = secrets.compare_digest(password.encode(), known_password.encode())
            found |= same_user and same_password
        return found


def basic_user(headers: Headers) -> str | None:
    """The user name of a request's basic auth (checked by the request guard before the route ran), or None."""
    offered = _credentials(headers.get("authorization", ""))
    return offered[0] if offered else None


def _credentials(header: str) -> tuple[str, str] | None:
    """(user, password) from an `Authorization: Basic …` header, or None when there is none."""
    scheme, _, encoded = header.partition(" ")
    if scheme.lower() != "basic" or not encoded.strip():
        return None
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        raise ApiError(401, "malformed basic auth header", CHALLENGE) from None
    user, sep, password = decoded.partition(":")
    return (user, password) if sep else None
