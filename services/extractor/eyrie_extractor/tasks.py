"""The JSON payloads of extract tasks on the queue."""

from pydantic import BaseModel, ConfigDict, Field


class ExtractTask(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    shard: int = Field(ge=0)
