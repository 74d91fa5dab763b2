"""The wire codec: every message type round-trips exactly (tensors bit for bit), and nothing else decodes.

msgpack only, never pickle: a frame can name a registered message class and carry ints, floats, strings, bytes,
lists, dicts and raw tensor bytes; it cannot make the receiver build or call anything else.
"""

from __future__ import annotations

import dataclasses
import pickle

import msgpack
import pytest
import torch

from engine.execution import codec
from workers import messages as m
from workers.law_channel import DraftLaws, pack_laws, unpack_laws
from workers.layer_skip import messages as ls

SPEC = m.SamplingSpec(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05, seed=(1 << 63) - 1)
GREEDY = m.SamplingSpec(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=None)
V = 257  # odd on purpose: no alignment luck


def _probs(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(n, V, generator=g), dim=-1)  # [n, V] float32


def _tree() -> m.DraftTree:
    return m.DraftTree(tokens=[5, 9, 11, 3], parents=[-1, -1, 0, 2], tree_id=12, kv_depth=2, likely_path=[1, 3])


def _examples() -> dict[str, object]:
    """One realistic instance per registered message class (the test below insists there is one for each)."""
    prefill = m.PrefillSeq(seq_id=3, block_table=[0, 7, 2], base_len=16, token_ids=[1, 2, 3], sample=SPEC)
    commit = m.DraftCommit(seq_id=3, num_inflight=1, nodes=[0, 2])
    guess = m.GuessSpec(at=-1, count=2, exclude=[17])
    draft_seq = m.DraftSeq(seq_id=3, block_table=[0, 7], base_len=12, token_ids=[44], sampling=SPEC,
                           branching=[2, 1, 1], pred_tokens=[8, 9], pred_parents=[-1, 0], guesses=[guess],
                           anchors=[-1, 1], grammar=m.DraftGrammar('start: "a"', 2, [7, 8]))
    verify = m.VerifySeq(seq_id=3, block_table=[0, 7], base_len=12, token_ids=[44], tree_tokens=[5, 9, 11, 3],
                         tree_parents=[-1, -1, 0, 2], sampling=SPEC, tree_id=12)
    result = m.VerifyResult(accepted_nodes=[0, 2], tokens=[5, 11, 60], num_accepted=2, bonus=False)
    probs = _probs(2, 1)
    return {
        "SamplingSpec": SPEC,
        "PrefillSeq": prefill,
        "DraftCommit": commit,
        "DraftTree": _tree(),
        "GuessSpec": guess,
        "DraftSeq": draft_seq,
        "DraftGrammar": draft_seq.grammar,
        "DraftStep": m.DraftStep(commits=[commit], prefills=[dataclasses.replace(prefill, sample=None)],
                                 seqs=[draft_seq], finished=[1, 2]),
        "DraftResult": m.DraftResult(seq_id=3, pred_tokens=[8, 9, 21], pred_parents=[-1, 0, -1], anchors=[-1, 2],
                                     trees=[_tree(), dataclasses.replace(_tree(), tree_id=-1)]),
        "DraftStepOutput": m.DraftStepOutput(results=[], elapsed_s=0.25),
        "VerifySeq": verify,
        "TargetStep": m.TargetStep(prefills=[prefill], seqs=[verify, dataclasses.replace(
            verify, seq_id=4, sampling=GREEDY, tree_id=-1)], finished=[7]),
        "VerifyResult": result,
        "TargetStepOutput": m.TargetStepOutput(first_tokens={3: 17, 12: 0}, results=[result], elapsed_s=1e-3,
                                               logprobs={3: m.TokenLogprobs([-0.5], [[17, 4]], [[-0.5, -2.25]])}),
        "TokenLogprobs": m.TokenLogprobs([-1.5, -0.125], [[1], [2]], [[-1.0], [-float("inf")]]),
        "WorkerReply": m.WorkerReply(result=m.TargetStepOutput(first_tokens={}, results=[result])),
        "TreeLaws": pack_laws(DraftLaws.of(3, 12, [probs[0], probs[1].where(probs[1] > 0.005, 0.0)])),
        # method layer_skip's self-draft call (workers/layer_skip/messages.py)
        "SelfDraftSeq": ls.SelfDraftSeq(seq_id=3, block_table=[0, 7], base_len=12, token_ids=[44], sampling=SPEC,
                                        num_tokens=4),
        "SelfDraftStep": ls.SelfDraftStep(seqs=[ls.SelfDraftSeq(4, [1], 0, [9, 8], GREEDY, 2)]),
        "SelfDraftOutput": ls.SelfDraftOutput(trees=[_tree()], elapsed_s=0.5),
    }


def _bits(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()  # NaN == NaN, -0 != 0


def assert_same(a: object, b: object, where: str = "msg") -> None:
    """Deep equality that treats tensors as equal only with the same dtype, shape and bits."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), \
            f"{where}: {a.dtype} {list(a.shape)} != {b.dtype} {list(b.shape)}"
        assert _bits(a) == _bits(b), f"{where}: values differ"
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def test_every_registered_type_has_an_example() -> None:
    # A new message class must be added to _examples() so that it is round-tripped below.
    assert set(_examples()) == set(codec._CLASSES)


@pytest.mark.parametrize("name", sorted(codec._CLASSES))
def test_round_trip_of_every_message_type(name: str) -> None:
    msg = _examples()[name]
    data = codec.encode(msg)
    assert isinstance(data, bytes)
    assert_same(codec.decode(data), msg)


def test_nested_messages_in_plain_containers() -> None:
    batch = {"step": _examples()["TargetStep"], "ids": [1, 2, 3], "name": "x", "blob": b"\x00\x01", "none": None}
    assert_same(codec.decode(codec.encode(batch)), batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.long, torch.int32,
                                   torch.uint8, torch.bool])
def test_tensors_round_trip_bit_for_bit(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, generator=g) * 1000).to(dtype)
    if dtype.is_floating_point:
        x[0, 0] = float("nan")
        x[0, 1] = float("inf")
        x[0, 2] = -0.0
    y = codec.decode(codec.encode(x))
    assert_same(y, x)
    y.add_(1) if dtype != torch.bool else y.logical_not_()  # the decoded tensor owns writable memory


def test_float32_probabilities_arrive_unchanged() -> None:
    # q must reach the verifier exactly as the draft sampled from it (docs/architecture.md: a wrong q is silent):
    # dense laws, top-k truncated laws, and i.i.d. siblings sharing one law, each bit for bit.
    q = torch.softmax(torch.randn(3, 4096, generator=torch.Generator().manual_seed(3)), dim=-1)
    top = q[1].topk(50)
    truncated = torch.zeros(4096).scatter(0, top.indices, top.values / top.values.sum())
    shared = q[0]
    laws = [shared, shared, truncated, q[2]]
    msg = codec.decode(codec.encode(pack_laws(DraftLaws.of(0, 5, laws))))
    assert msg.sizes == [-1, 50, -1] and msg.node_law == [0, 0, 1, 2]  # the shared law travels once
    out = unpack_laws(msg, 4, "cpu")
    assert out.dtype == torch.float32
    assert _bits(out) == _bits(torch.stack(laws))
    assert _bits(unpack_laws(msg, 3, "cpu")) == _bits(torch.stack(laws[:3]))  # a tree pruned to a prefix


def test_tensor_shapes_views_and_empties() -> None:
    base = torch.arange(24, dtype=torch.long).reshape(4, 6)
    for x in (base.t(), base[:, ::2], torch.tensor(7), torch.empty(3, 0), torch.empty(0, dtype=torch.bfloat16),
              torch.ones(2, 3, dtype=torch.bfloat16)[:, 1:], torch.tensor(1.5, dtype=torch.bfloat16)):
        assert_same(codec.decode(codec.encode(x)), x.contiguous())


def test_int_dict_keys_and_big_ints_survive() -> None:
    out = codec.decode(codec.encode(m.TargetStepOutput(first_tokens={0: 1, 2**40: 3}, results=[])))
    assert out.first_tokens == {0: 1, 2**40: 3}
    assert codec.decode(codec.encode(SPEC)).seed == (1 << 63) - 1


@dataclasses.dataclass
class NotAMessage:
    x: int = 1


class Exploit:
    def __reduce__(self):  # what pickle would call on load
        return (print, ("pwned",))


@pytest.mark.parametrize("obj", [NotAMessage(), Exploit(), object(), {1, 2}, 1j])
def test_unregistered_objects_are_refused_on_encode(obj: object) -> None:
    with pytest.raises(TypeError, match="not a registered message type"):
        codec.encode(obj)


def test_unknown_type_name_is_rejected_on_decode() -> None:
    fake = msgpack.ExtType(codec._EXT_DATACLASS, msgpack.packb(["Popen", [["rm", "-rf", "/"]]], use_bin_type=True))
    with pytest.raises(ValueError, match="unknown message type 'Popen'"):
        codec.decode(msgpack.packb(fake, use_bin_type=True))


def test_wrong_field_count_is_rejected_on_decode() -> None:
    fake = msgpack.ExtType(codec._EXT_DATACLASS, msgpack.packb(["DraftCommit", [[1], 2, 3, 4]], use_bin_type=True))
    with pytest.raises((ValueError, TypeError)):
        codec.decode(msgpack.packb(fake, use_bin_type=True))


def test_unknown_extension_code_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown msgpack extension code 42"):
        codec.decode(msgpack.packb(msgpack.ExtType(42, b"\x00"), use_bin_type=True))


def test_unknown_tensor_dtype_is_rejected() -> None:
    fake = msgpack.ExtType(codec._EXT_TENSOR, msgpack.packb(["object", [1], b"\x00" * 8]))
    with pytest.raises((TypeError, ValueError)):
        codec.decode(msgpack.packb(fake, use_bin_type=True))


def test_no_pickle_anywhere() -> None:
    # A pickle frame is not a valid msgpack message: decode fails or yields plain data, never the object.
    frame = pickle.dumps(Exploit())
    try:
        out = codec.decode(frame)
    except Exception:
        return
    assert isinstance(out, (int, float, str, bytes, list, dict, type(None))), type(out)
    # And the encoded form of a message holds no pickle opcodes' framing (protocol 2+ starts with b"\x80").
    assert not codec.encode(_examples()["TargetStep"]).startswith(b"\x80")


def test_codec_module_does_not_import_pickle() -> None:
    import inspect

    src = inspect.getsource(codec)
    assert "import pickle" not in src and "cloudpickle" not in src
