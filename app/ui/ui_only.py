"""UI-only handlers: what runs the page's own events (the Diagnostics tab's "free memory", the debug
switches, the Generate tab's buttons) runs for those events only.

Gradio lets anyone who can reach the queue call any handler by its `fn_index`, the ones its API
docs hide (`api_visibility="private"`) included. Scripts have the documented API, which does the
same things with checks of its own; a private handler is served only when both hold:

- the request comes from the app's own page in a browser: `Sec-Fetch-Site: same-origin`, or,
  where browsers send no such header (plain HTTP), an `Origin` equal to `Host` (a cross-site
  page can fake neither);
- it names, as Gradio's page does, the component whose event runs the handler (`trigger_id`): one
  of the handler's own triggers, or for a chained handler (`.then`, `.success`) its chain's first
  one; a page-load handler may name none.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.datastructures import Headers

API_PREFIX = "/gradio_api"
# Routes that name the handler they run: /call/<name>, /call/v2/<name>, /run/<name>, /api/<name>.
NAMED_ROUTES = tuple(f"{API_PREFIX}/{route}/" for route in ("call/v2", "call", "run", "api"))
PAGE_EVENTS = ("load", "unload")  # events of the page itself, which Gradio's page sends without a component


def private_handler_refusal(demo, path: str, data: dict, headers: Headers) -> str | None:
    """Why the request may not run the private handler it names, or None (not private, or allowed)."""
    fn = _handler(demo, path, data.get("fn_index"))
    if fn is None or fn.api_visibility != "private":
        return None
    if not from_own_page(headers):
        return (f"handler {fn.api_name!r} belongs to the app's page; scripts use the documented API "
                "(the 'Use via API' link)")
    if data.get("trigger_id") not in _triggers(demo, fn):
        return f"handler {fn.api_name!r} runs only for its own events on the app's page"
    return None


def _handler(demo, path: str, fn_index):
    """The handler a request would run: by `fn_index` when given (Gradio prefers it), else by route name."""
    if isinstance(fn_index, int) and not isinstance(fn_index, bool):
        return demo.fns.get(fn_index)
    route = next((r for r in NAMED_ROUTES if path.startswith(r)), None)
    if route is None:
        return None
    name = path[len(route):].strip("/").split("/")[0]
    return next((fn for fn in demo.fns.values() if fn.api_name == name), None)


def _triggers(demo, fn) -> set[int | None]:
    """The component ids whose events run `fn`: its chain's first handler's targets (Gradio's page
    sends the first event's component along a `.then` chain); None for a page event."""
    seen = set()
    while fn.trigger_after is not None and fn.trigger_after not in seen and fn.trigger_after in demo.fns:
        seen.add(fn.trigger_after)
        fn = demo.fns[fn.trigger_after]
    ids: set[int | None] = {block for block, _event in fn.targets}
    if any(event in PAGE_EVENTS for _block, event in fn.targets):
        ids.add(None)
    return ids


def from_own_page(headers: Headers) -> bool:
    """A request made by the app's own page in a browser (which a cross-site page cannot fake)."""
    site = headers.get("sec-fetch-site")
    if site is not None:
        return site == "same-origin"
    origin = headers.get("origin")
    return origin is not None and urlsplit(origin).netloc == headers.get("host")
