"""The grpcio transport: requests in the protobuf JSON mapping (dicts) go
through google.protobuf.json_format to the generated stubs in
canzona/_proto and back. Importing this module fails (ImportError) where
grpcio or protobuf is missing; canzona then uses canzona-bridge.

Connection, deadlines, the bearer token and TLS follow client/lib/client.cc
(the C++ client): the same per-method deadlines, "cannot reach canzonad at
<target>" errors, no cap on response sizes.

Thread-safety: thread-safe (gRPC channels and stubs are).
"""

import grpc
from google.protobuf import json_format

from canzona._errors import CanzonaError
from canzona._proto import optimizer_service_pb2 as _pb
from canzona._proto import optimizer_service_pb2_grpc as _pb_grpc
from canzona._targets import is_unix_target

# Methods whose deadline is one of the options' (the others get 30 s).
_DEADLINES = {
    "Register": "register_timeout",
    "Step": "step_timeout",
    "GradReady": "step_timeout",
    "WaitParams": "step_timeout",
    "SaveCheckpoint": "checkpoint_timeout",
    "LoadCheckpoint": "checkpoint_timeout",
    "ExportState": "checkpoint_timeout",
    "ImportState": "checkpoint_timeout",
}
_DEFAULT_DEADLINE = 30.0


def _ca_pem(tls_ca):
    """tls_ca as PEM text: the text itself, or the file it names."""
    if "-----BEGIN " in tls_ca:
        return tls_ca
    try:
        with open(tls_ca) as f:
            text = f.read()
    except (OSError, UnicodeDecodeError):
        text = ""
    if "-----BEGIN " not in text:
        raise CanzonaError("tls_ca: cannot read a PEM certificate from '%s'"
                           % tls_ca, "INVALID_ARGUMENT")
    return text


def _to_dict(message):
    """The JSON mapping with original field names and every field that has
    no presence printed (what the C++ side prints)."""
    try:
        return json_format.MessageToDict(
            message, preserving_proto_field_name=True,
            always_print_fields_with_no_presence=True)
    except TypeError:  # protobuf < 5.26 names the option differently
        return json_format.MessageToDict(
            message, preserving_proto_field_name=True,
            including_default_value_fields=True)


class GrpcTransport:
    """A channel to one canzonad; ``call`` runs one unary RPC."""

    name = "grpc"

    def __init__(self, options):
        target = options.target
        self._target = target
        channel_options = [("grpc.max_receive_message_length", -1)]
        tls = bool(options.tls_ca) and not is_unix_target(target)
        if tls:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_ca_pem(options.tls_ca).encode())
            channel = grpc.secure_channel(target, credentials,
                                          options=channel_options)
        else:
            channel = grpc.insecure_channel(target, options=channel_options)
        try:
            grpc.channel_ready_future(channel).result(
                timeout=options.connect_timeout)
        except grpc.FutureTimeoutError:
            channel.close()
            raise CanzonaError(
                "cannot reach canzonad at %s%s" % (target, (
                    " (is the daemon running, with TLS on that port and a "
                    "certificate for this host signed by tls_ca?)" if tls
                    else " (is the daemon running?)")),
                "UNAVAILABLE") from None
        self._channel = channel
        stub = _pb_grpc.OptimizerServiceStub(channel)
        service = _pb.DESCRIPTOR.services_by_name["OptimizerService"]
        self._methods = {}
        for method in service.methods:
            deadline = _DEADLINES.get(method.name)
            self._methods[method.name] = (
                getattr(stub, method.name),
                getattr(_pb, method.input_type.name),
                getattr(options, deadline) if deadline else _DEFAULT_DEADLINE)
        self._metadata = ((("authorization", "Bearer " + options.job_token),)
                          if options.job_token else None)

    def call(self, method, request):
        """Runs ``method`` on ``request`` (a dict); returns the response as
        a dict. CanzonaError with the call's status otherwise."""
        _, request_type, _ = self._methods[method]
        try:
            message = json_format.ParseDict(request, request_type())
        except json_format.ParseError as e:
            raise CanzonaError("request: %s" % e, "INVALID_ARGUMENT") from None
        return _to_dict(self.call_message(method, message))

    def call_message(self, method, message):
        """Runs ``method`` on ``message`` (its request message); returns the
        response message: bulk bytes (a rank's state) skip the JSON
        mapping's base64 both ways."""
        rpc, _, deadline = self._methods[method]
        try:
            return rpc(message, timeout=deadline, metadata=self._metadata)
        except grpc.RpcError as e:
            code = e.code()
            if code == grpc.StatusCode.UNAVAILABLE:
                raise CanzonaError("cannot reach canzonad at %s: %s"
                                   % (self._target, e.details()),
                                   code.name) from None
            raise CanzonaError(e.details() or "", code.name) from None

    def close(self):
        self._channel.close()
