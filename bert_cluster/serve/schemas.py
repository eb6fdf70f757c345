"""The request and answer shapes, as pydantic models: FastAPI validates every request against them.

``EmbeddingsRequest`` / ``EmbeddingsResponse``: OpenAI's ``POST /v1/embeddings`` (strings only, not token
arrays; ``truncate`` is this server's addition). ``EmbedRequest``: TEI's ``POST /embed`` (its answer is a
bare list of vectors). ``ErrorResponse``: the one error shape of every route, OpenAI's.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

#: Unknown fields and mistyped values are refused (strict: "1" is not a bool, 1 is not a string).
STRICT = ConfigDict(extra="forbid", strict=True)


class EmbeddingsRequest(BaseModel):
    """OpenAI's embeddings request."""

    model_config = STRICT

    input: str | list[str] = Field(description="A text or a list of texts.")
    model: str | None = Field(None, description="Accepted and ignored: the server has one model.")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="float: lists of numbers; base64: little-endian float32 bytes, base64."
    )
    dimensions: int | None = Field(None, description="Must be the model's dimension if given.")
    user: str | None = Field(None, description="Accepted and ignored.")
    truncate: bool = Field(False, description="Cut inputs past max_input_tokens instead of refusing them.")


class EmbedRequest(BaseModel):
    """TEI's embed request."""

    model_config = STRICT

    inputs: str | list[str] = Field(description="A text or a list of texts.")
    normalize: bool = Field(True, description="Scale each vector to unit length.")
    truncate: bool = Field(False, description="Cut inputs past max_input_tokens instead of refusing them.")


class Embedding(BaseModel):
    """One vector of an ``EmbeddingsResponse``."""

    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class Usage(BaseModel):
    """Tokens the model read (after truncation, with the special tokens)."""

    prompt_tokens: int
    total_tokens: int


class EmbeddingsResponse(BaseModel):
    """OpenAI's embeddings answer: ``data[i].index`` is the input's position in the request."""

    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: Usage


class ErrorBody(BaseModel):
    """What went wrong and what is allowed; ``code`` is the HTTP status."""

    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """Every error answer of the server."""

    error: ErrorBody
