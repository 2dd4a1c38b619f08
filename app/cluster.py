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
"""

# No `from __future__ import annotations`: Serve's ingress re-declares the routes, and FastAPI must see
# the request models as classes there, not as strings, to read them from the body.
import argparse
import hashlib
import logging
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.exceptions import RayActorError, RayTaskError

from app.a1111 import img2img, txt2img
from app.a1111.errors import A1111Route, ApiError
from app.a1111.options import OVERRIDABLE
from app.a1111.schema import Img2ImgRequest, Txt2ImgRequest
from app.a1111.state import ApiState
from app.adapters.prompt import parse_prompt_loras
from app.settings import Settings

log = logging.getLogger(__name__)
RETRIES = 1  # a request whose replica died is sent once more


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
        from app.ui.accounts import quota
        from app.ui.common import UiContext, checkpoint_names

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


gateway_api = FastAPI(title="Steady Diffusion on Ray Serve")
gateway_api.router.route_class = A1111Route  # refusals and failures in A1111's error JSON, as the app answers


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress(gateway_api)
class Gateway:
    """The `/sdapi/v1` generation routes; each request goes to a replica by its state key."""

    def __init__(self, replicas) -> None:
        self.replicas = replicas

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
    """The Serve application: `replicas` engines (`gpus` GPUs and `cpus` CPUs each) behind the gateway."""
    engines = EngineReplica.options(num_replicas=replicas, ray_actor_options={"num_gpus": gpus, "num_cpus": cpus})
    return Gateway.bind(engines.bind(settings, initial_model))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.cluster", description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", required=True, help="the A1111-layout data folder, the same path on every node")
    p.add_argument("--replicas", type=int, default=1, help="engines to run, one GPU each")
    p.add_argument("--cpu", action="store_true", help="CPU replicas (a test or a machine without GPUs)")
    p.add_argument("--address", default=None, help="a running Ray cluster (auto, HEAD_IP:6379); default: a local one")
    p.add_argument("--host", default="127.0.0.1", help="where the A1111 API listens (0.0.0.0 for all interfaces)")
    p.add_argument("--port", type=int, default=8000, help="the A1111 API's port")
    p.add_argument("--model", default=None, help="checkpoint each replica loads at start (default: the first found)")
    args = p.parse_args(argv)
    import ray

    logging.basicConfig(level=logging.INFO)
    ray.init(address=args.address)
    serve.start(http_options={"host": args.host, "port": args.port})
    settings = Settings(data_dir=Path(args.data_dir))
    serve.run(build(settings, args.replicas, gpus=0 if args.cpu else 1, initial_model=args.model), route_prefix="/")
    print(f"A1111 API at http://{args.host}:{args.port}/sdapi/v1 on {args.replicas} engine replica(s); Ctrl+C stops",
          flush=True)
    try:
        import time

        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
