"""Every message round-trips the codec; large arrays go as zero-copy frames, small ones inline."""

from __future__ import annotations

import inspect
import typing
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from m3serve.runtime import messages as m
from m3serve.runtime.codec import ZERO_COPY_THRESHOLD, Codec

# The channel unions, plus the in-process scheduler <-> executor pair, which has none.
CHANNELS: list[Any] = [
    m.ToTokenizer,
    m.ToScheduler,
    m.ToApi,
    m.ToSupervisor,
    m.ToHiCache,
    m.FromHiCache,
    m.StepPlan | m.StepResult,
]

ints = st.integers(-(2**63), 2**63 - 1)
small_ints = st.integers(-(2**31), 2**31 - 1)
tokens = st.integers(0, 2**31 - 1)
floats = st.floats(allow_nan=False)  # NaN != NaN would fail the comparison, not the codec
texts = st.text(max_size=12)
json_values = st.recursive(
    st.none() | st.booleans() | ints | floats | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=8,
)
json_dicts = st.dictionaries(texts, json_values, max_size=3)
token_lists = st.lists(tokens, max_size=8)
# Up to 2.4 KB: both sides of ZERO_COPY_THRESHOLD.
token_arrays = hnp.arrays(np.int32, st.integers(0, 600), elements=tokens)

token_ids = st.one_of(
    token_arrays.map(lambda a: m.TokenIds(count=a.size, array=a)),
    st.builds(
        m.TokenIds,
        count=st.integers(0, 10**9),
        shm=st.builds(m.ShmRef, texts, st.integers(0, 2**62)),
    ),
)
sampling = st.builds(
    m.SamplingParams,
    max_new_tokens=st.none() | small_ints,
    temperature=floats,
    top_p=floats,
    top_k=small_ints,
    min_p=floats,
    presence_penalty=floats,
    frequency_penalty=floats,
    repetition_penalty=floats,
    stop=st.lists(texts, max_size=3),
    stop_token_ids=token_lists,
    ignore_eos=st.booleans(),
    seed=st.none() | ints,
    logprobs=st.booleans(),
    top_logprobs=small_ints,
    skip_special_tokens=st.booleans(),
)
finishes = st.none() | st.builds(
    m.Finish, st.sampled_from(typing.get_args(m.FinishReason)), st.none() | ints | texts
)
logprobs = st.builds(
    m.TokenLogprob, tokens, floats, st.lists(st.tuples(tokens, floats), max_size=3)
)
logprob_lists = st.none() | st.lists(st.lists(logprobs, max_size=2), max_size=3)
seq_steps = st.builds(
    m.SeqStep,
    input_ids=st.none() | token_lists,
    start=small_ints,
    pages=token_lists,
    slot=small_ints,
    sample=st.booleans(),
    new_request=st.booleans(),
)
request_outputs = st.builds(
    m.RequestOutput,
    rid=texts,
    text=texts,
    output_ids=token_lists,
    finish=finishes,
    usage=st.builds(m.Usage, tokens, tokens, tokens),
    logprobs=st.lists(logprobs, max_size=2),
)

STRATEGIES: dict[type, st.SearchStrategy[Any]] = {
    m.GenerateReq: st.builds(
        m.GenerateReq,
        rid=texts,
        prompt=st.none() | texts,
        messages=st.none() | st.lists(json_dicts, max_size=3),
        input_ids=st.none() | token_ids,
        tools=st.none() | st.lists(json_dicts, max_size=2),
        sampling=sampling,
        stream=st.booleans(),
        thinking=st.none() | texts,
        reasoning_effort=st.none() | texts,
        chat_template_kwargs=st.none() | json_dicts,
        assistant_prefix=st.none() | texts,
    ),
    m.Abort: st.builds(m.Abort, texts),
    m.TokenizeReq: st.builds(
        m.TokenizeReq,
        rid=texts,
        prompt=st.none() | texts,
        messages=st.none() | st.lists(json_dicts, max_size=3),
        add_generation_prompt=st.booleans(),
    ),
    m.DetokenizeReq: st.builds(m.DetokenizeReq, texts, token_lists),
    m.TokenizeResult: st.builds(m.TokenizeResult, texts, token_lists),
    m.DetokenizeResult: st.builds(m.DetokenizeResult, texts, texts),
    m.Tokenized: st.builds(
        m.Tokenized,
        rid=texts,
        input_ids=token_ids,
        sampling=sampling,
        stop_token_ids=token_lists,
        max_new_tokens=small_ints,
        fit_to_pool=st.booleans(),
        worker=small_ints,
    ),
    m.TokenBatch: st.builds(
        m.TokenBatch,
        rids=st.lists(texts, max_size=4),
        new_ids=st.lists(token_lists, max_size=4),
        finish=st.lists(finishes, max_size=4),
        cached_tokens=token_lists,
        logprobs=logprob_lists,
    ),
    m.TextBatch: st.builds(m.TextBatch, st.lists(request_outputs, max_size=4)),
    m.Ready: st.builds(m.Ready, texts, small_ints, json_dicts),
    m.Error: st.builds(m.Error, st.none() | texts, texts, small_ints),
    m.Shutdown: st.just(m.Shutdown()),
    m.HostPoolSpec: st.builds(m.HostPoolSpec, small_ints, small_ints, small_ints),
    m.HostPoolReady: st.builds(
        m.HostPoolReady, texts, small_ints, small_ints, small_ints, small_ints
    ),
    m.Backup: st.builds(m.Backup, small_ints, st.lists(texts, max_size=4), token_lists),
    m.Prefetch: st.builds(m.Prefetch, small_ints, st.lists(texts, max_size=4), token_lists),
    m.Done: st.builds(m.Done, small_ints, small_ints, st.none() | texts),
    m.StepPlan: st.builds(
        m.StepPlan,
        step=small_ints,
        seqs=st.lists(seq_steps, max_size=3),
        sampling=st.dictionaries(small_ints, sampling, max_size=2),
        prompt_ids=st.dictionaries(small_ints, token_lists, max_size=2),
        output_ids=st.dictionaries(small_ints, token_lists, max_size=2),
    ),
    m.StepResult: st.builds(
        m.StepResult,
        step=small_ints,
        slots=token_lists,
        tokens=token_lists,
        logprobs=st.lists(st.none() | logprobs, max_size=3),
    ),
}


def plain(msg: Any) -> Any:
    """Builtins for comparing messages: Struct equality cannot compare array fields."""

    def array_as_builtins(obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            return ["ndarray", obj.dtype.str, list(obj.shape), obj.tolist()]
        raise NotImplementedError

    return msgspec.to_builtins(msg, enc_hook=array_as_builtins)


def received(frames: list[Any]) -> list[bytes]:
    """The frames as a receiver gets them: fresh buffers, not the sender's memory."""
    return [bytes(frame) for frame in frames]


def tokenized(ids: np.ndarray) -> m.Tokenized:
    return m.Tokenized(
        rid="r1",
        input_ids=m.TokenIds(count=ids.size, array=ids),
        sampling=m.SamplingParams(),
        stop_token_ids=[2],
        max_new_tokens=16,
        fit_to_pool=False,
        worker=0,
    )


def test_every_message_type_has_a_round_trip_strategy() -> None:
    tagged = {
        cls
        for _, cls in inspect.getmembers(m, inspect.isclass)
        if issubclass(cls, msgspec.Struct) and cls.__struct_config__.tag is not None
    }
    assert tagged == set(STRATEGIES)


@pytest.mark.parametrize("msg_type", list(STRATEGIES), ids=lambda t: t.__name__)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_message_round_trips_through_each_channel_that_carries_it(
    msg_type: type, data: st.DataObject
) -> None:
    msg = data.draw(STRATEGIES[msg_type])
    channels = [ch for ch in CHANNELS if msg_type in typing.get_args(ch)]
    assert channels
    for channel in channels:
        codec: Codec[Any] = Codec(channel)
        decoded = codec.decode(received(codec.encode(msg)))
        assert type(decoded) is msg_type
        assert plain(decoded) == plain(msg)


def test_a_large_array_travels_as_its_own_frame_and_decodes_as_a_view_of_it() -> None:
    ids = np.arange(10_000, dtype=np.int32)
    codec: Codec[m.ToScheduler] = Codec(m.ToScheduler)
    frames = received(codec.encode(tokenized(ids)))
    assert len(frames) == 2
    assert len(frames[1]) == ids.nbytes

    decoded = codec.decode(frames)
    assert isinstance(decoded, m.Tokenized)
    array = decoded.input_ids.array
    assert array is not None
    assert np.array_equal(array, ids)
    assert array.dtype == np.int32
    assert np.shares_memory(array, np.frombuffer(frames[1], np.uint8))
    assert not array.flags.writeable  # a view of the received buffer, not a private copy


def test_encoding_hands_out_the_arrays_memory_without_copying() -> None:
    ids = np.arange(10_000, dtype=np.int32)
    frames = Codec(m.ToScheduler).encode(tokenized(ids))
    assert np.shares_memory(np.frombuffer(frames[1], np.uint8), ids)


def test_small_arrays_travel_inside_the_body_and_decode_writable() -> None:
    ids = np.arange(5, dtype=np.int32)
    codec: Codec[m.ToScheduler] = Codec(m.ToScheduler)
    frames = codec.encode(tokenized(ids))
    assert len(frames) == 1

    decoded = codec.decode(received(frames))
    assert isinstance(decoded, m.Tokenized)
    array = decoded.input_ids.array
    assert array is not None
    assert np.array_equal(array, ids)
    assert array.flags.writeable


def test_the_threshold_is_inclusive() -> None:
    codec: Codec[m.ToScheduler] = Codec(m.ToScheduler)
    at = np.zeros(ZERO_COPY_THRESHOLD // 4, np.int32)
    below = np.zeros(ZERO_COPY_THRESHOLD // 4 - 1, np.int32)
    assert len(codec.encode(tokenized(at))) == 2
    assert len(codec.encode(tokenized(below))) == 1


def test_100k_token_ids_leave_the_body_at_a_few_hundred_bytes() -> None:
    frames = Codec(m.ToScheduler).encode(tokenized(np.arange(100_000, dtype=np.int32)))
    assert len(frames[0]) < 300
    assert sum(len(memoryview(frame)) for frame in frames[1:]) == 400_000


@pytest.mark.parametrize(
    "array",
    [
        np.arange(12, dtype=np.float64).reshape(3, 4)[:, ::2],  # not contiguous
        np.arange(2000, dtype=np.float32).reshape(20, 100).T,  # Fortran order, out of band
        np.array(3.5),  # zero-dimensional
        np.zeros((0, 3), np.int64),
        np.arange(600, dtype=">u2"),  # big-endian
        np.array([True, False]),
    ],
    ids=["strided", "transposed", "scalar", "empty", "big-endian", "bool"],
)
def test_arrays_of_any_shape_layout_and_dtype_keep_both(array: np.ndarray) -> None:
    codec: Codec[m.ToApi] = Codec(m.ToApi)
    decoded = codec.decode(received(codec.encode(m.Ready("executor", 1, {"x": array}))))
    assert isinstance(decoded, m.Ready)
    out = decoded.info["x"]
    assert out.dtype == array.dtype
    assert out.shape == array.shape
    assert np.array_equal(out, array)


def test_arrays_of_python_objects_are_refused() -> None:
    with pytest.raises(TypeError, match="object"):
        Codec(m.ToApi).encode(m.Ready("a", 1, {"x": np.array([object()])}))


def test_numpy_scalars_encode_as_plain_numbers() -> None:
    codec: Codec[m.ToScheduler] = Codec(m.ToScheduler)
    msg = tokenized(np.arange(3, dtype=np.int32))
    msg.worker = np.int64(3)  # type: ignore[assignment]
    decoded = codec.decode(codec.encode(msg))
    assert isinstance(decoded, m.Tokenized)
    assert decoded.worker == 3
    assert type(decoded.worker) is int


def test_a_message_of_another_channel_is_rejected() -> None:
    frames = Codec(m.ToApi).encode(m.Ready("a", 1))
    with pytest.raises(msgspec.ValidationError):
        Codec(m.ToScheduler).decode(frames)


def test_a_missing_array_frame_is_an_error() -> None:
    codec: Codec[m.ToScheduler] = Codec(m.ToScheduler)
    frames = codec.encode(tokenized(np.arange(10_000, dtype=np.int32)))
    with pytest.raises(ValueError, match="frame 1 missing"):
        codec.decode(frames[:1])
