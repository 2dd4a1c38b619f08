"""Past one box: the A1111 API on Ray Serve, each replica a whole engine on one GPU.

    pip install -e ".[cluster]"
    python -m app.cluster --data-dir /shared/sd --replicas 2            # one machine, a local Ray
    ray start --head                                                      # a cluster: on the head node
    ray start --address HEAD_IP:6379                                      # on every GPU node
    python -m app.cluster --address auto --data-dir /shared/sd --replicas 8

Why Ray Serve and no RPC of our own: Serve already starts, health-checks and replaces replicas,
routes requests and carries their results and errors between machines. Each replica
(`EngineReplica`, `num_gpus=1`) holds one `Engine` with the app's own A1111 handlers
(`app.a1111.txt2img`, `app.a1111.img2img`), so it makes the same images as the app, each request
with its own state (its checkpoint from `override_settings`, no LoRA but its prompt tags). The
`Gateway` speaks the same `/sdapi/v1` routes and sends each request to a replica through Serve's
model multiplexing, keyed by the state the request needs (checkpoint and LoRA tags): Serve prefers
a replica that served that key last, which is one that holds that model and LoRA set.

A replica that dies mid-request (a killed process, a lost node) is replaced by Serve; the gateway
sends its request once more to a live replica and, if that fails too, answers 503 saying so. Every
node reads the same `--data-dir` (a shared folder, or the same files at the same path).

The gateway takes the app's logins (`app.logins`: `--auth`, `--auth-file`, `--auth-env`, `--api-auth`; a
generated password when it listens beyond loopback without them) as HTTP basic auth, through the app's own
`BasicAuth` and login throttle, and the app's body caps (`app.a1111.body_limits`), both decided from the
request's headers before its body is read (`Gateway.refusal`); the replicas run the app's handlers, so a
request meets the app's own caps and validation there. Serve's proxy streams a body to the gateway as it
arrives and stops reading it once the gateway's refusal is sent.

A CPU replica computes with one torch thread per Ray CPU it holds: its pixels equal the app's for the
same request when the app computes on the same kind of device with as many threads (CPU sums taken in
another order round differently).
"""

# No `from __future__ import annotations`: Serve's ingress re-declares the routes, and FastAPI must see
# the request models as classes there, not as strings, to read them from the body.
import argparse
import hashlib
import logging
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from starlette.datastructures import Headers

from app.a1111 import api_gate, body_limits, img2img, txt2img
from app.a1111.auth import api_enabled
from app.a1111.errors import A1111Route, ApiError, error_response
from app.a1111.options import OVERRIDABLE
from app.a1111.schema import Img2ImgRequest, Txt2ImgRequest
from app.a1111.state import ApiState
from app.adapters.prompt import parse_prompt_loras
from app.logins import add_login_flags, login_settings
from app.settings import Settings
from app.ui.guard import SAFE_METHODS, GuardPolicy, loopback_hosts

log = logging.getLogger(__name__)
RETRIES = 1  # a request whose replica died is sent once more
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def state_key(body: dict[str, Any]) -> str:
    """The routing key of a request: the checkpoint it asks for and its LoRA tags (not its other numbers),
    so requests needing the same model and LoRA set meet on the same replica."""
    checkpoint = str((body.get("override_settings") or {}).get(OVERRIDABLE, ""))
    try:
        loras = parse_prompt_loras(str(body.get("prompt") or ""))[1]
    except ValueError:
        loras = ()  # a bad tag is refused by the replica, with the message
    text = checkpoint + "|" + ",".join(f"{s.name}:{s.unet_strength:g}:{s.te_strength:g}" for s in loras)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# One request at a time per replica: a busy replica is offered none, so Serve's router sends the next to a
# free one, preferring one that holds its state (the engine would only queue it).
@serve.deployment(ray_actor_options={"num_gpus": 1}, max_ongoing_requests=1)
class EngineReplica:
    """One engine on this replica's device, loaded with the first checkpoint, behind the app's own handlers."""

    def __init__(self, settings: Settings, initial_model: str | None = None) -> None:
        import ray
        import torch

        from app.engine.worker import Engine
        from app.ui.common import UiContext, checkpoint_names
        from app.ui.login_jobs import quota

        gpus = ray.get_gpu_ids()
        device = "cuda" if gpus else "cpu"  # Ray sets CUDA_VISIBLE_DEVICES: the replica sees its one GPU
        if not gpus:
            torch.set_num_threads(max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1))))
        settings = settings.replace(device=device, devices=())
        self.engine = Engine(settings)
        first = initial_model or next(iter(checkpoint_names(settings)), None)
        if first is not None:
            self.engine.load_model(first)
        self.state = ApiState(UiContext(self.engine, settings), quota(settings, logins=False))

    @serve.multiplexed(max_num_models_per_replica=1)
    async def _hold(self, key: str) -> str:
        """Serve's record of which state this replica serves: the engine reconciles per request anyway."""
        return key

    async def txt2img(self, body: dict[str, Any]) -> dict:
        await self._hold(serve.get_multiplexed_model_id())
        request = Txt2ImgRequest(**body)
        return await self.state.run("txt2img", lambda: txt2img.run(self.state, request))

    async def img2img(self, body: dict[str, Any]) -> dict:
        await self._hold(serve.get_multiplexed_model_id())
        request = Img2ImgRequest(**body)
        return await self.state.run("img2img", lambda: img2img.run(self.state, request))


def client_key(scope: dict, headers: Headers) -> str:
    """The client a failed login counts against: the address Serve's proxy gives the request.

    The proxy's uvicorn takes that address from `X-Forwarded-For` when the connection comes from loopback
    (its default trust), so a local program could name a new address per guess. A request whose address is
    one its own `X-Forwarded-For` names therefore counts as one client with every other such request, as
    all clients of one reverse proxy count as the proxy's address in the app.
    """
    host = (scope.get("client") or ("unknown",))[0]
    named = {part.strip() for value in headers.getlist("x-forwarded-for") for part in value.split(",")}
    return "a forwarding proxy" if host in named else host


def _refused(status: int, detail: str) -> JSONResponse:
    return error_response(status, "HTTPException", detail, f"{status}: {detail}")


class GatewayGuard:
    """A layer around the gateway's routes, ahead of FastAPI reading any body: a request this replica's
    `Gateway` refuses from its headers is answered before its body is read. The `Gateway` is found as Serve's
    own class-based routes find it (the replica context), since Serve builds this app before it."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        refusal = serve.get_replica_context().servable_object.refusal(scope) if scope["type"] == "http" else None
        await (refusal or self.app)(scope, receive, send)


gateway_api = FastAPI(title="Steady Diffusion on Ray Serve")
gateway_api.router.route_class = A1111Route  # refusals and failures in A1111's error JSON, as the app answers
gateway_api.add_middleware(GatewayGuard)


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress(gateway_api)
class Gateway:
    """The `/sdapi/v1` generation routes behind the app's login and body caps; each request goes to a replica
    by its state key."""

    def __init__(self, replicas, settings: Settings) -> None:
        self.replicas = replicas
        self.login = api_gate(settings, settings.auth)
        hosts = None if settings.listen else loopback_hosts(settings.port)
        self.policy = GuardPolicy(hosts, settings.session_queue_size, body_limits=body_limits(settings))

    def refusal(self, scope: dict) -> JSONResponse | None:
        """The app's checks that need no body, in the app's order: Host (on loopback, against DNS rebinding),
        cross-site and login (`BasicAuth`, throttled per `client_key`), then the declared body size. A body
        must declare its size (A1111's clients do): the cap then holds without reading a byte of it."""
        headers = Headers(scope=scope)
        allowed = self.policy.allowed_hosts
        if allowed is not None and headers.get("host") not in allowed:
            return _refused(403, f"this server answers only to {', '.join(sorted(allowed))}")
        answer = self.login({**scope, "client": (client_key(scope, headers), 0)})
        if answer is not None or scope["method"] in SAFE_METHODS:
            return answer
        declared, limit = headers.get("content-length", ""), self.policy.body_limit(scope["path"])
        if not declared.isdigit():
            return _refused(411, "send the request body with a Content-Length header (chunked bodies are refused)")
        if int(declared) > limit:
            return _refused(413, f"request body over {limit:,} bytes")
        return None

    @gateway_api.post("/sdapi/v1/txt2img")
    async def txt2img(self, req: Txt2ImgRequest) -> dict:
        return await self.forward("txt2img", req.model_dump())

    @gateway_api.post("/sdapi/v1/img2img")
    async def img2img(self, req: Img2ImgRequest) -> dict:
        return await self.forward("img2img", req.model_dump())

    async def forward(self, route: str, body: dict[str, Any]) -> dict:
        """The replica's answer; its refusal re-raised as the replica raised it (A1111's error JSON)."""
        handle = self.replicas.options(multiplexed_model_id=state_key(body))
        for attempt in range(RETRIES + 1):
            try:
                return await getattr(handle, route).remote(body)
            except RayTaskError as exc:
                raise exc.cause if isinstance(exc.cause, Exception) else exc from None
            except RayActorError as exc:
                log.warning("replica died serving %s (attempt %d): %s", route, attempt + 1, exc)
                if attempt == RETRIES:
                    raise ApiError(503, f"the engine replica serving this request stopped ({type(exc).__name__}) "
                                        "and so did the one it was sent to again; Ray Serve is replacing them, "
                                        "send the request again") from None
        raise AssertionError("unreachable")


def build(settings: Settings, replicas: int = 2, *, gpus: float = 1, cpus: float = 1,
          initial_model: str | None = None):
    """The Serve application: `replicas` engines (`gpus` GPUs and `cpus` CPUs each) behind the gateway, which
    takes `settings`' logins (`settings.auth` holds any generated password) and body caps."""
    engines = EngineReplica.options(num_replicas=replicas, ray_actor_options={"num_gpus": gpus, "num_cpus": cpus})
    engine_settings = settings.replace(auth=(), api_auth=())  # the logins stay with the gateway, off the GPU nodes
    return Gateway.bind(engines.bind(engine_settings, initial_model), settings)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m app.cluster", description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", required=True, help="the A1111-layout data folder, the same path on every node")
    p.add_argument("--replicas", type=int, default=1, help="engines to run, one GPU each")
    p.add_argument("--cpu", action="store_true", help="CPU replicas (a test or a machine without GPUs)")
    p.add_argument("--address", default=None, help="a running Ray cluster (auto, HEAD_IP:6379); default: a local one")
    p.add_argument("--host", default="127.0.0.1", help="where the A1111 API listens (0.0.0.0 for all interfaces)")
    p.add_argument("--port", type=int, default=8000, help="the A1111 API's port")
    p.add_argument("--model", default=None, help="checkpoint each replica loads at start (default: the first found)")
    p.add_argument("--max-upload-mib", type=int, default=Settings.max_upload_mib,
                   help="largest image a request may carry (img2img), as the app's flag")
    add_login_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    import ray

    from app.ui.serve import auth_policy

    settings = Settings(data_dir=Path(args.data_dir), listen=args.host not in LOOPBACK, port=args.port,
                        max_upload_mib=args.max_upload_mib, **login_settings(args))
    policy = auth_policy(settings)  # the app's rule: beyond loopback, no login given and no --no-auth: one made up
    if not api_enabled(settings, policy.credentials):
        print(f"Not serving: the A1111 API on {args.host} would be open to anyone who can reach it. Add --api-auth "
              "USER:PASS (or --auth) to serve it behind a login, or --api to serve it open.", flush=True)
        return 2
    settings = settings.replace(auth=policy.credentials)
    logging.basicConfig(level=logging.INFO)
    ray.init(address=args.address)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(build(settings, args.replicas, gpus=0 if args.cpu else 1, initial_model=args.model), route_prefix="/")
    print(f"A1111 API at http://{args.host}:{args.port}/sdapi/v1 on {args.replicas} engine replica(s); Ctrl+C stops",
          flush=True)
    if policy.generated_password:
        print(f"HTTP basic auth required. user: {policy.credentials[0][0]}  password: {policy.generated_password}\n"
              "(generated for this run and shown only once; choose your own with --auth or --api-auth)", flush=True)
    try:
        import time

        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
