"""Runs that train on another run's generated answers and hidden states (eyrie.runs.reuse): each
such run is recorded beside the run that owns the objects (`runs/OWNER/used-by/RUN.json`), and the
store refuses to delete the owner's answers or states while any run uses them (Store.delete)."""

from __future__ import annotations

from eyrie.core.errors import EyrieError
from eyrie.data.manifest import Layout, now_iso


class StatesInUse(EyrieError):
    """A deletion of objects another run trains on."""


def add_user(store, owner: str, user: str) -> None:
    store.put_json(Layout(owner).user(user), {"run": user, "since": now_iso()})


def users_of(store, owner: str) -> list[str]:
    """The runs that train on `owner`'s answers and hidden states."""
    return [key.rpartition("/")[2].removesuffix(".json") for key in store.list(Layout(owner).users)]


def refuse_deleting_used(store, key: str) -> None:
    """Raises StatesInUse where `key` is one of a run's answers or hidden states that another run uses."""
    owner = Layout.owner_of_shared(key)
    if owner and (users := users_of(store, owner)):
        raise StatesInUse(f"{key} is one of run {owner}'s generated answers or hidden states, which run(s) "
                          f"{', '.join(users)} train on: not deleted.",
                          f"keep run {owner}'s states while {', '.join(users)} need them (their manifests' "
                          f"states_from); a run that uses them is recorded under {Layout(owner).users}.")
