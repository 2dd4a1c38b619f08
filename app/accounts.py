"""Accounts: who asks (a login, or the one local user), and who may change what every user shares.

Why: a shared server has several logins (`--auth` repeated, `--auth-file`, `--auth-env`, the A1111
API's `--api-auth`), and some switches act on the one engine everybody draws with: unloading the
model, the debug switches, dtype, offload and weight storage, the per-LoRA and per-checkpoint
choices remembered in the data folder, stopping another user's job, the shared `styles.csv`. One
user flipping those reaches every other user, so they belong to an admin:

- `--admin USER` (repeatable) names the admins; without it the FIRST login listed is the admin
  (`--auth` first, then `--api-auth`; the password generated for `--listen`/`--share` is the one login);
- the `--admin` names count for the UI's and the A1111 API's logins alike (a name is one account
  whichever way it logs in);
- with no login at all (loopback, or `--no-auth`) every request is the one local user, `LOCAL`,
  who is the admin: there is nobody to tell apart.

Everything else a user chooses (checkpoint, LoRAs, clip skip, own styles) is per session or per
account (`app/ui/sessions.py`, `app/styles.py`) and needs no admin.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

LOCAL = "local"  # the account of every request when no login is asked


@dataclass(frozen=True)
class Account:
    name: str
    admin: bool


LOCAL_ACCOUNT = Account(LOCAL, True)  # every request's account when no login is asked: the admin


class AdminRequired(PermissionError):
    """An engine-wide switch asked for by an account that is not an admin (HTTP 403 in the API)."""

    def __init__(self, action: str, account: Account) -> None:
        super().__init__(f"{action} changes the engine for every user: it needs an admin login (--admin USER; "
                         f"by default the first login listed); {account.name!r} is not an admin")


@dataclass(frozen=True)
class Accounts:
    """The served app's admins, and whether the UI and the API ask for a login (`ui_logins`, `api_logins`).
    The default (no login anywhere) makes every request the local admin, as on loopback."""

    admins: frozenset[str] = frozenset()
    ui_logins: bool = False
    api_logins: bool = False

    @classmethod
    def from_logins(cls, admins: Iterable[str], ui_logins: Iterable[tuple[str, str]],
                    api_logins: Iterable[tuple[str, str]]) -> Accounts:
        """`admins` (`--admin`) or else the first login of the UI's, then of the API's."""
        ui_users, api_users = [u for u, _p in ui_logins], [u for u, _p in api_logins]
        named = tuple(admins) or (ui_users + api_users)[:1]
        return cls(frozenset(named), bool(ui_users), bool(api_users))

    def _of(self, user: str | None, logins: bool) -> Account:
        if not logins:
            return LOCAL_ACCOUNT
        if not user:  # cannot happen behind the login; never an admin if it did
            return Account("", False)
        return Account(user, user in self.admins)

    def ui(self, username: str | None) -> Account:
        """The account of a Gradio request (`gr.Request.username`, set by the login)."""
        return self._of(username, self.ui_logins)

    def api(self, user: str | None) -> Account:
        """The account of an A1111 API request: its basic-auth user, already checked by the request guard."""
        return self._of(user, self.api_logins)


def require_admin(account: Account, action: str) -> Account:
    """`account` when it is an admin; else `AdminRequired` naming `action`."""
    if not account.admin:
        raise AdminRequired(action, account)
    return account
