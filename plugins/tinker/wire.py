"""The Tinker SDK's wire formats, read and written with its own protobuf schema
(``tinker.proto.tinker_public_pb2``, the contract since SDK 0.25): ``forward_backward``
requests come in as protobuf (zstd-compressed when the server's client config asks for it,
which this one does not), its outputs and ``sample``'s go back as protobuf, everything else is
JSON. Decoded data is plain Python: token lists and numpy arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["Datum", "Refused", "FwdBwdRequest", "decode_forward_backward", "encode_forward_backward_output",
           "encode_sample_response", "tensor_from_json"]

_DENSE = {"float32": np.float32, "int64": np.int64}


class Refused(ValueError):
    """A request tinker-serve does not serve (or cannot, as sent); the message says which and why."""


def _pb():
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


@dataclass
class Datum:
    """One training example: the input tokens and the loss inputs by name (``target_tokens``,
    ``weights``, ``logprobs``, ``advantages``...), each a numpy array."""

    tokens: list[int]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class FwdBwdRequest:
    """A decoded ``/api/v1/forward_backward`` body."""

    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float | str]
    forward_only: bool
    data: list[Datum]


def _tensor(msg) -> np.ndarray:
    pb = _pb()
    dtypes = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
    if msg.dtype not in dtypes:
        raise Refused(f"a loss input has dtype {msg.dtype}; float32 and int64 are served")
    shape = list(msg.shape)
    if msg.HasField("sparse_csr"):
        values = np.frombuffer(msg.sparse_csr.values, dtype=dtypes[msg.dtype])
        crow = np.frombuffer(msg.sparse_csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(msg.sparse_csr.col_indices, dtype=np.int64)
        dense = np.zeros(shape, dtype=dtypes[msg.dtype])
        for row in range(len(crow) - 1):
            dense[row, col[crow[row]:crow[row + 1]]] = values[crow[row]:crow[row + 1]]
        return dense
    array = np.frombuffer(msg.dense, dtype=dtypes[msg.dtype]).copy()
    return array.reshape(shape) if shape else array


def decode_forward_backward(body: bytes, encoding: str | None) -> FwdBwdRequest:
    """The protobuf ``ForwardBackwardRequest`` in ``body`` (zstd when ``encoding`` says so).
    Image and audio chunks are refused: this server trains text models."""
    if encoding == "zstd":
        import zstandard

        body = zstandard.ZstdDecompressor().decompress(body, max_output_size=1 << 31)
    msg = _pb().ForwardBackwardRequest()
    msg.ParseFromString(body)
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else float(value.number)
    data = []
    for datum in msg.data:
        tokens: list[int] = []
        for chunk in datum.model_input:
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise Refused(f"a model input holds a {kind} chunk; tinker-serve trains on text (encoded_text) only")
            tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
        data.append(Datum(tokens, {name: _tensor(t) for name, t in datum.loss_fn_inputs.items()}))
    return FwdBwdRequest(msg.model_id, msg.seq_id, msg.loss_fn, config, msg.forward_only, data)


def _batched(arrays: list[np.ndarray], dtype) -> object:
    pb = _pb()
    bt = pb.BatchedTensor()
    bt.dtype = {np.float32: pb.DTYPE_FLOAT32, np.int64: pb.DTYPE_INT64}[dtype]
    offsets, total, chunks = [0], 0, []
    for array in arrays:
        raw = np.ascontiguousarray(array, dtype=dtype).tobytes()
        chunks.append(raw)
        total += len(raw)
        offsets.append(total)
    bt.data = b"".join(chunks)
    bt.offsets = np.asarray(offsets, dtype=np.int64).tobytes()
    return bt


def encode_forward_backward_output(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """A ``ForwardBackwardOutput``: one ``ArrayRecord`` whose fields (``logprobs``,
    ``elementwise_loss``) hold each datum's float32 row, and the metrics."""
    pb = _pb()
    msg = pb.ForwardBackwardOutput()
    msg.loss_fn_output_type = "ArrayRecord"
    for key, value in metrics.items():
        msg.metrics[key] = float(value)
    record = msg.loss_fn_outputs.add()
    record.num_datums = len(outputs)
    for name in (outputs[0] if outputs else {}):
        record.fields[name].CopyFrom(_batched([o[name] for o in outputs], np.float32))
    return msg.SerializeToString()


def encode_sample_response(sequences: list[tuple[list[int], list[float], str]],
                           prompt_logprobs: list[float] | None) -> bytes:
    """A ``SampleResponse``: each sequence's tokens, their log-probs and why it stopped
    (``stop`` or ``length``); ``prompt_logprobs`` (NaN at position 0) when asked."""
    pb = _pb()
    msg = pb.SampleResponse()
    reasons = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
    for tokens, logprobs, reason in sequences:
        seq = msg.sequences.add()
        seq.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(logprobs, dtype=np.float32).tobytes()
        seq.stop_reason = reasons[reason]
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return msg.SerializeToString()


def tensor_from_json(value: dict) -> np.ndarray:
    """A JSON ``TensorData`` (``data``, ``dtype``, ``shape``) as a numpy array."""
    array = np.asarray(value["data"], dtype=_DENSE[value.get("dtype", "float32")])
    shape = value.get("shape")
    return array.reshape(shape) if shape else array
