"""kubelet's side of device plugin registration, over real gRPC on a Unix socket."""

from __future__ import annotations

import queue
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from appliance.kube._generated import deviceplugin_v1beta1_pb2 as pb
from appliance.kube._generated import deviceplugin_v1beta1_pb2_grpc as pb_grpc


class FakeKubelet(pb_grpc.RegistrationServicer):  # type: ignore[misc]
    """kubelet's Registration service on `<dir>/kubelet.sock`; records every request."""

    def __init__(self, directory: Path) -> None:
        self.requests: queue.Queue[pb.RegisterRequest] = queue.Queue()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pb_grpc.add_RegistrationServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix://{directory / 'kubelet.sock'}")
        self.server.start()

    def Register(self, request: pb.RegisterRequest, context: Any) -> pb.Empty:  # noqa: N802
        self.requests.put(request)
        return pb.Empty()

    def stop(self) -> None:
        self.server.stop(grace=None).wait()
