"""Errors of the cluster API, named after the container service's exception types so that
boto3 clients raise the same classes they would against the real service."""

from __future__ import annotations


class ECSError(Exception):
    """Base: ``code`` is the service's exception type name, sent as ``__type`` on the wire."""

    code = "ServerException"
    status = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ClientException(ECSError):
    code = "ClientException"
    status = 400


class InvalidParameterException(ECSError):
    code = "InvalidParameterException"
    status = 400


class ClusterNotFoundException(ECSError):
    code = "ClusterNotFoundException"
    status = 400


class ServerException(ECSError):
    code = "ServerException"
    status = 500


class AccessDeniedException(ECSError):
    code = "AccessDeniedException"
    status = 400


class UnknownOperationException(ECSError):
    code = "UnknownOperationException"
    status = 400


class UnrecognizedClientException(ECSError):
    """The access key id is not one the server knows (HTTP 403 in the service, too)."""

    code = "UnrecognizedClientException"
    status = 403


class InvalidSignatureException(ECSError):
    """The SigV4 signature does not match the request."""

    code = "InvalidSignatureException"
    status = 403


class ThrottlingException(ECSError):
    """Too many connections or requests at once; retry later."""

    code = "ThrottlingException"
    status = 400


class ServiceNotFoundException(ECSError):
    code = "ServiceNotFoundException"
    status = 400


class ServiceNotActiveException(ECSError):
    code = "ServiceNotActiveException"
    status = 400


class ResourceNotFoundException(ECSError):
    code = "ResourceNotFoundException"
    status = 400
