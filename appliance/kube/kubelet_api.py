"""kubelet's device plugin API (v1beta1), as generated from `proto/` into `_generated/`.

The generated modules are untyped (typed protobuf stubs would need types-protobuf and a
plugin); loading them by name keeps mypy --strict out of generated code. Messages are `Any`
where they are used, and the tests hold the shapes kubelet sees.
"""

from __future__ import annotations

import importlib
from typing import Any

pb: Any = importlib.import_module("appliance.kube._generated.deviceplugin_v1beta1_pb2")
pb_grpc: Any = importlib.import_module("appliance.kube._generated.deviceplugin_v1beta1_pb2_grpc")
