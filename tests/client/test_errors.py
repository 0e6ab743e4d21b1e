"""The one mapping table from status codes to exception classes."""

from __future__ import annotations

import grpc
import pytest

from kvpool_client import errors


class FakeRpcError(grpc.RpcError, grpc.Call):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details

    # grpc.Call's other abstract methods; unused here.
    def initial_metadata(self): ...
    def trailing_metadata(self): ...
    def is_active(self): ...
    def time_remaining(self): ...
    def cancel(self): ...
    def add_callback(self, callback): ...


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (grpc.StatusCode.NOT_FOUND, errors.NotFoundError),
        (grpc.StatusCode.ALREADY_EXISTS, errors.AlreadyExistsError),
        (grpc.StatusCode.INVALID_ARGUMENT, errors.InvalidArgumentError),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.ResourceExhaustedError),
        (grpc.StatusCode.FAILED_PRECONDITION, errors.FailedPreconditionError),
        (grpc.StatusCode.UNAVAILABLE, errors.UnavailableError),
        (grpc.StatusCode.DEADLINE_EXCEEDED, errors.DeadlineExceededError),
        (grpc.StatusCode.INTERNAL, errors.InternalError),
        (grpc.StatusCode.UNIMPLEMENTED, errors.UnimplementedError),
        (grpc.StatusCode.PERMISSION_DENIED, errors.PermissionDeniedError),
        (grpc.StatusCode.UNAUTHENTICATED, errors.UnauthenticatedError),
        (grpc.StatusCode.DATA_LOSS, errors.UnknownError),
    ],
)
def test_each_code_maps_to_its_class(code, cls):
    exc = errors.from_rpc_error(FakeRpcError(code, "sequence 7 not found"), "Free")
    assert type(exc) is cls
    assert isinstance(exc, errors.KVPoolClientError)
    assert exc.code == code  # the real code, even for the UnknownError fallback
    assert exc.details == "sequence 7 not found" and exc.method == "Free"
    assert code.name in str(exc) and "Free" in str(exc)


def test_python_base_classes_for_idiomatic_catching():
    assert issubclass(errors.InvalidArgumentError, ValueError)
    assert issubclass(errors.DeadlineExceededError, TimeoutError)
    assert len(set(errors.ERROR_FOR_CODE.values())) == len(errors.ERROR_FOR_CODE)
