"""vLLM's tokenizer routes: /tokenize, /detokenize and /tokenizer_info."""

import os
from typing import Any

from fastapi import APIRouter, Request

from mlaserve.server.protocol_extras import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
)
from mlaserve.server.routes.docs import errors
from mlaserve.server.state import serving

router = APIRouter()


@router.post("/tokenize", responses=errors(400, 401, 404, 408, 413, 503))
async def tokenize(req: TokenizeRequest, request: Request) -> TokenizeResponse:
    return await serving(request).tokenize(req)


@router.post("/detokenize", responses=errors(400, 401, 404, 408, 413, 503))
async def detokenize(req: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    return await serving(request).detokenize(req)


@router.get("/tokenizer_info", responses=errors(401, 503))
async def tokenizer_info(request: Request) -> TokenizerInfoResponse:
    s = serving(request)
    tok = s.tokenizer
    info: dict[str, Any] = {}
    for key, value in tok.init_kwargs.items():
        if hasattr(value, "content"):  # AddedToken
            value = value.content
        if (isinstance(value, (str, int, float, bool)) or value is None) \
                and _public_tokenizer_value(key, value):
            info[key] = value
    for key in ("eos_token", "bos_token", "pad_token", "unk_token"):
        info[key] = getattr(tok, key, None)
    info["chat_template"] = tok.chat_template
    info["tokenizer_class"] = type(tok).__name__
    info["model_max_length"] = s.max_model_len
    return TokenizerInfoResponse(**info)


def _public_tokenizer_value(key: str, value: Any) -> bool:
    """Tokenizer settings that are fit to publish: no file system paths."""
    if key in ("name_or_path", "vocab_file", "merges_file", "tokenizer_file"):
        return False
    return not (isinstance(value, str) and os.path.isabs(value))
