"""The train stage's settings, declared once: a run config's `train:` section, the `eyrie train`
options (eyrie/cli_options.py makes them from these fields) and a train task's request are this
model; the run manifest records the plan made from it (eyrie.manifest.TrainParams)."""

from __future__ import annotations

from pydantic import Field, model_serializer, model_validator

from eyrie.section import Section

MAX_HELDOUT = 500


class TrainSettings(Section):
    """What the train stage asks for. A setting not given takes the default here, or on a rerun
    what was planned: which ones were given is kept (model_fields_set), and only those are
    written out (a stored config, a task's payload), so a rerun checks only what was asked."""

    base: str | None = Field(None, description="Finetune from this drafter: HF repo id or directory "
                                               "(legacy EAGLE-3 format is converted).")
    base_revision: str | None = Field(None, description="Revision of --base on the hub.")
    epochs: int = Field(10, ge=1, description="Epochs.")
    max_steps: int | None = Field(None, ge=1, description="Stop after this many steps in total.")
    draft_vocab: int = Field(32000, ge=2, description="Draft vocabulary, capped at the target's.")
    lr: float = Field(1e-4, gt=0, description="Learning rate.")
    seq_len: int = Field(8192, ge=16, description="Tokens per packed batch; longer samples are cut there "
                                                  "(speculators' --total-seq-len).")
    ttt_steps: int = Field(3, ge=1, le=16, description="Draft steps trained and evaluated: K.")
    heldout: int | None = Field(None, ge=1, description="Samples held out for evaluation "
                                                        f"(default 10%, at most {MAX_HELDOUT}).")

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, data):
        """null (a config written before the defaults lived here, a JSON client): not given."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    @model_serializer(mode="wrap")
    def _given_only(self, handler):
        return {name: value for name, value in handler(self).items() if name in self.model_fields_set}

    def given(self) -> dict:
        """The settings asked for, by name (not the defaults)."""
        return {name: getattr(self, name) for name in type(self).model_fields if name in self.model_fields_set}

    def heldout_for(self, samples: int) -> int:
        return self.heldout or max(1, min(MAX_HELDOUT, samples // 10))
