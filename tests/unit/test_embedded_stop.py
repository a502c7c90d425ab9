"""The demo's stop waits past `eyrie serve`'s own stop of its model server (a process group of its own):
killed sooner, the model server outlived it, orphaned (seen when a demo was stopped mid-generation)."""

from eyrie.commands import embedded
from eyrie_inference.server import Server


def test_the_demo_waits_for_a_server_longer_than_the_server_waits_for_its_model_server():
    assert embedded.STOP_S > Server.STOP_GRACE_S + Server.POLL_S
