"""The AUTOMATIC1111 web API (`/sdapi/v1/...`) on the app's own server, for the clients people already use.

Open WebUI, SillyTavern, chat bots and `webuiapi` scripts drive image backends through A1111's
REST API; this package speaks it beside the Gradio UI, on the same port, behind the same request
guard (Host allow-list, the login checked before a body is read, per-route body caps; see `auth`).
Every call reaches the model through the engine's queue like the UI's, with the UI's input rules.
Our own extras live under `/steady/v1/...` (`steady`).

`install_api` adds the routes to the launched Gradio app. They go in front of Gradio's own routes:
Gradio has built its app by then, and the routes carry their own error handling (`errors`).
"""

from __future__ import annotations

from app.a1111.adetailer import adetailer_router
from app.a1111.auth import BasicAuth, api_enabled, api_logins
from app.a1111.routes import sdapi_router
from app.a1111.state import ApiState
from app.a1111.steady import steady_router
from app.settings import Settings
from app.ui.common import UiContext
from app.ui.login_jobs import quota

GATED_PREFIXES = ("/sdapi/", "/steady/", "/adetailer/")  # behind the API's login, checked by the request guard
# The routes that take base64 images in their JSON; every other route has the guard's 1 MiB cap.
IMAGE_ROUTES = ("/sdapi/v1/img2img", "/sdapi/v1/png-info", "/sdapi/v1/extra-single-image",
                "/sdapi/v1/extra-batch-images")


def api_body_bytes(settings: Settings) -> int:
    """The largest API request body: an image of `--max-upload-mib` in base64 (4/3 larger) plus the JSON around it."""
    return settings.max_upload_mib * 2**20 * 4 // 3 + 2**16


def body_limits(settings: Settings) -> tuple[tuple[str, int], ...]:
    """The guard's per-route body caps for the API (`GuardPolicy.body_limits`)."""
    return tuple((route, api_body_bytes(settings)) for route in IMAGE_ROUTES)


def api_gate(settings: Settings, ui_logins: tuple[tuple[str, str], ...]) -> BasicAuth:
    """The API's login, for the request guard to check before a body is read."""
    return BasicAuth(api_logins(settings, ui_logins))


def install_api(app, ctx: UiContext, ui_logins: tuple[tuple[str, str], ...]) -> str:
    """Serve the API on `app` when the policy allows it; returns the console line that says how."""
    settings = ctx.settings
    if not api_enabled(settings, ui_logins):
        return ("A1111 API (/sdapi/v1) is off: the app is reachable without a login. Add --api-auth USER:PASS "
                "(or --auth) to serve it behind one, or --api to serve it open.")
    state = ApiState(ctx, quota(settings, bool(api_logins(settings, ui_logins))))
    routes = [*sdapi_router(state).routes, *steady_router(state).routes, *adetailer_router(state).routes]
    for route in routes:
        route.data_dir = settings.data_dir  # its answers name files relative to the data folder
    app.router.routes[0:0] = routes
    return _describe(settings, api_logins(settings, ui_logins))


def _describe(settings: Settings, logins: tuple[tuple[str, str], ...]) -> str:
    if logins:
        source = "--api-auth" if settings.api_auth else "the UI's login"
        return f"A1111 API at /sdapi/v1 (HTTP basic auth with {source})."
    if settings.listen or settings.share:
        return "A1111 API at /sdapi/v1, open to anyone who can reach it (--api without a login)."
    return "A1111 API at /sdapi/v1 (no login: the app answers on this machine only)."
