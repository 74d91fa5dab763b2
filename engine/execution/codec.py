"""msgpack encoding of the typed messages that cross process boundaries (never pickle on a socket).

Dataclasses travel as (registered class name, field values); tensors as (dtype, shape, raw bytes), so a
float32 q arrives bit-identical. Only registered classes can be decoded: a socket cannot make us build
anything else.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import numpy as np
import torch

from workers import messages
from workers.law_channel import TreeLaws
from workers.layer_skip.messages import SelfDraftOutput, SelfDraftSeq, SelfDraftStep

_EXT_DATACLASS = 1
_EXT_TENSOR = 2

_CLASSES: dict[str, type] = {
    cls.__name__: cls
    for cls in (messages.SamplingSpec, messages.PrefillSeq, messages.DraftCommit, messages.DraftSeq,
                messages.DraftStep, messages.GuessSpec, messages.DraftTree, messages.DraftResult,
                messages.DraftStepOutput, messages.VerifySeq, messages.TargetStep, messages.VerifyResult,
                messages.TargetStepOutput, messages.WorkerReply, messages.TokenLogprobs, TreeLaws,
                SelfDraftSeq, SelfDraftStep, SelfDraftOutput, messages.DraftGrammar)
}
_FIELDS: dict[type, tuple[str, ...]] = {
    cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in _CLASSES.values()
}


def _default(obj: Any) -> msgpack.ExtType:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        raw = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()
        return msgpack.ExtType(_EXT_TENSOR, msgpack.packb([dtype, list(t.shape), raw]))
    cls = type(obj)
    names = _FIELDS.get(cls)
    if names is None:
        raise TypeError(f"cannot encode {cls.__name__}: not a registered message type")
    values = [getattr(obj, n) for n in names]
    return msgpack.ExtType(_EXT_DATACLASS, msgpack.packb([cls.__name__, values], default=_default,
                                                         use_bin_type=True))


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _EXT_TENSOR:
        dtype, shape, raw = msgpack.unpackb(data)
        if dtype == "bfloat16":
            # numpy has no bfloat16: carry the bits as int16 (torch.frombuffer refuses an empty buffer).
            return torch.from_numpy(np.frombuffer(raw, dtype=np.int16).copy()).view(torch.bfloat16).reshape(shape)
        return torch.from_numpy(np.frombuffer(raw, dtype=np.dtype(dtype)).copy()).reshape(shape)
    if code == _EXT_DATACLASS:
        name, values = msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
        cls = _CLASSES.get(name)
        if cls is None:
            raise ValueError(f"unknown message type {name!r}")
        return cls(**dict(zip(_FIELDS[cls], values, strict=True)))
    raise ValueError(f"unknown msgpack extension code {code}")


def encode(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_default, use_bin_type=True)


def decode(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
