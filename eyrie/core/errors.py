"""One error type for everything a user can fix: it names the problem and the fix."""


class EyrieError(Exception):
    """A failure the user can act on. The CLI prints `problem` and `fix` on one line each."""

    def __init__(self, problem: str, fix: str = ""):
        super().__init__(problem)
        self.problem = problem
        self.fix = fix

    def __str__(self) -> str:
        return f"{self.problem} Fix: {self.fix}" if self.fix else self.problem


class UnknownRun(EyrieError):
    """No run of that name in the store (the API answers 404)."""
