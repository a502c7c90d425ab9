"""A SIGTERM/SIGINT during training, remembered and raised where a checkpoint can be saved."""

import os
import signal


class StopSignal:
    """SIGTERM/SIGINT while training: remembered, then raised as speculators' handler does (it saves
    a resumable checkpoint). Its own handler raises once and forgets; a raise that lands in the
    data path (a request to the extraction service) is caught there as a failed attempt and
    retried, and the stop was lost. Remembered, it is raised again at the step's end; and from a
    step's update to its count (state["updating"]) it is only remembered, so a checkpoint never holds
    an update without its step."""

    def __init__(self, state: dict):
        self.state, self.owner = state, os.getpid()

    def __enter__(self):
        self.previous = {sig: signal.signal(sig, self._handler) for sig in (signal.SIGTERM, signal.SIGINT)}

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handler(self, signum, frame) -> None:
        from speculators.train.graceful_shutdown import TrainingInterruptedError

        if os.getpid() != self.owner:  # a forked data-loader worker: the trainer process decides
            return
        first = not self.state.get("signalled")
        self.state["signalled"] = signal.Signals(signum).name
        if first and not self.state.get("updating"):  # mid-update: raised at the step's end
            raise TrainingInterruptedError(self.state["signalled"])
