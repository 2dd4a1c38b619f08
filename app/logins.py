"""The login flags (`--auth`, `--auth-file`, `--auth-env`, `--admin`, `--no-auth`, `--api`, `--api-auth`), read
the same way by the app (`launch.py`) and by its A1111 API on Ray Serve (`python -m app.cluster`): whoever may
log in to one may log in to the other, with the same spelling of the same flags.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from app.secret_env import pop_secret


def add_login_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--auth", action="append", default=[], metavar="USER:PASS", help="require a login (repeatable)")
    p.add_argument("--auth-file", default=None, help="file with one user:password per line")
    p.add_argument("--auth-env", default=None, metavar="VAR",
                   help="environment variable holding user:password (one per line); unlike --auth not shown by ps")
    p.add_argument("--admin", action="append", default=[], metavar="USER",
                   help="a login that may change what every user shares: unload, debug switches, dtype/offload/"
                        "weight storage, the remembered per-LoRA choices, stopping others' jobs, the shared "
                        "styles.csv (repeatable; counts for --api-auth logins too). Default: the first login listed "
                        "(--auth, then --api-auth); with no login the local user is the admin")
    p.add_argument("--no-auth", action="store_true",
                   help="allow --share/--listen (the Ray gateway: a --host beyond loopback) without a password "
                        "(otherwise one is generated)")
    p.add_argument("--api", action="store_true",
                   help="serve the A1111 API (/sdapi/v1) even when the app is reachable without a login; it is on "
                        "by default on 127.0.0.1 and behind a login")
    p.add_argument("--api-auth", action="append", default=[], metavar="USER:PASS[,USER:PASS]",
                   help="separate logins (HTTP basic) for the A1111 API, as A1111's --api-auth; default: the UI's")


def login_settings(args: argparse.Namespace) -> dict:
    """The `Settings` fields the login flags set."""
    return {"auth": parse_auth(args.auth, args.auth_file, args.auth_env), "no_auth": args.no_auth,
            "admins": tuple(args.admin), "api": args.api,
            "api_auth": parse_auth([pair for arg in args.api_auth for pair in arg.split(",")], None)}


def parse_auth(pairs: list[str], auth_file: str | None, auth_env: str | None = None) -> tuple[tuple[str, str], ...]:
    """`user:pass` pairs from the command line, a file and/or an environment variable, one pair per line.

    The variable is removed from the environment once read (`app.secret_env`): processes started
    later (Gradio's share tunnel) do not inherit it, `/proc/PID/environ` no longer shows it, and
    unlike `--auth` it never shows in `ps`.
    """
    lines = list(pairs)
    texts = [Path(auth_file).read_text()] if auth_file else []
    if auth_env:
        secret = pop_secret(auth_env)
        if not secret:
            raise SystemExit(f"--auth-env {auth_env}: that environment variable is not set or empty")
        texts.append(secret)
    for text in texts:
        lines += [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    out = []
    for line in lines:
        user, sep, password = line.partition(":")
        if not sep or not user or not password:
            raise SystemExit(f"--auth expects user:password, got {line.split(':')[0]!r}:…")
        out.append((user, password))
    return tuple(out)
