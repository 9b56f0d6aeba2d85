"""The device plugin against a fake kubelet (real gRPC on a Unix socket) and a real client."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from fake_kubelet import FakeKubelet

from appliance.core.gpus import GpuFacts
from appliance.kube._generated import deviceplugin_v1beta1_pb2 as pb
from appliance.kube._generated import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from appliance.kube.deviceplugin import DevicePlugin
from appliance.kube.devices import preferred_devices

GiB = 1 << 30
WAIT = 20.0  # an upper bound for things that happen in milliseconds; never a measurement


class Gpus:
    """The GPUs and their health as the plugin's callables see them; tests flip health."""

    def __init__(self) -> None:
        self.unhealthy: set[str] = set()
        self.load = {"GPU-a": 3, "GPU-b": 0}

    def inventory(self) -> list[GpuFacts]:
        return [
            GpuFacts("GPU-a", index=0, model="H200", memory_total=141 * GiB),
            GpuFacts("GPU-b", index=1, model="H200", memory_total=141 * GiB),
            GpuFacts("GPU-m", index=2, model="A100", memory_total=80 * GiB, mig_enabled=True),
        ]

    def healthy(self, uuid: str) -> bool:
        if self.broken:
            raise RuntimeError("NVML: GPU is lost")
        return uuid not in self.unhealthy

    broken = False  # the health query raises, as NVML can


@pytest.fixture
def gpus() -> Gpus:
    return Gpus()


@pytest.fixture
def host(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The node's filesystem as the daemon sees it: the hook's directory, CDI specs."""
    return tmp_path_factory.mktemp("host")


@pytest.fixture
def plugin(tmp_path: Path, host: Path, gpus: Gpus) -> Iterator[DevicePlugin]:
    plugin = DevicePlugin(
        gpus=gpus.inventory,
        health=gpus.healthy,
        replicas_per_gpu=4,
        resource_name="nvshare.com/gpu",
        kubelet_dir=tmp_path,
        hook_host_path=str(host / "lib" / "libnvshare.so"),
        socket_host_dir="/var/run/nvshare",
        load=lambda: gpus.load,
        cdi_spec_dirs=[host / "etc-cdi", host / "run-cdi"],
        gpu_index={"GPU-a": 0, "GPU-b": 1}.get,
        health_interval_s=0.05,
        register_retry_s=0.1,
    )
    yield plugin
    plugin.stop()


def stub(plugin: DevicePlugin) -> Iterator[pb_grpc.DevicePluginStub]:
    with grpc.insecure_channel(f"unix://{plugin.socket_path}") as channel:
        yield pb_grpc.DevicePluginStub(channel)


@pytest.fixture
def client(plugin: DevicePlugin) -> Iterator[Any]:
    yield from stub(plugin)


def test_registers_with_kubelet_and_advertises_replicas_of_non_mig_gpus(
    tmp_path: Path, plugin: DevicePlugin, gpus: Gpus
) -> None:
    kubelet = FakeKubelet(tmp_path)
    try:
        plugin.start()
        request = kubelet.requests.get(timeout=WAIT)
        assert request.version == "v1beta1"
        assert request.endpoint == "nvshare.sock" and (tmp_path / request.endpoint).exists()
        assert request.resource_name == "nvshare.com/gpu"
        assert request.options.get_preferred_allocation_available
        with grpc.insecure_channel(f"unix://{tmp_path / request.endpoint}") as channel:
            client = pb_grpc.DevicePluginStub(channel)
            options = client.GetDevicePluginOptions(pb.Empty(), timeout=WAIT)
            assert options.get_preferred_allocation_available and not options.pre_start_required
            stream = client.ListAndWatch(pb.Empty(), timeout=WAIT)
            first = next(stream)
            assert sorted(d.ID for d in first.devices) == [
                f"GPU-{g}::{n}" for g in "ab" for n in range(4)
            ]
            assert {d.health for d in first.devices} == {"Healthy"}
            gpus.unhealthy.add("GPU-b")
            second = next(stream)
            health = {d.ID: d.health for d in second.devices}
            assert health["GPU-b::0"] == "Unhealthy" and health["GPU-a::0"] == "Healthy"
            plugin.set_replicas(2)  # a policy reload: kubelet hears of it on the same stream
            third = next(stream)
            assert sorted(d.ID for d in third.devices) == [
                f"GPU-{g}::{n}" for g in "ab" for n in range(2)
            ]
            stream.cancel()
    finally:
        kubelet.stop()


def test_a_failing_health_query_is_logged_and_health_is_followed_again(
    tmp_path: Path, plugin: DevicePlugin, gpus: Gpus, caplog: pytest.LogCaptureFixture
) -> None:
    kubelet = FakeKubelet(tmp_path)
    try:
        plugin.start()
        kubelet.requests.get(timeout=WAIT)
        with grpc.insecure_channel(f"unix://{plugin.socket_path}") as channel:
            stream = pb_grpc.DevicePluginStub(channel).ListAndWatch(pb.Empty(), timeout=WAIT)
            assert {d.health for d in next(stream).devices} == {"Healthy"}
            gpus.broken = True
            deadline = time.monotonic() + WAIT
            while "listing GPUs for the device plugin failed" not in caplog.text:
                assert time.monotonic() < deadline, "the failure was not logged"
                time.sleep(0.02)
            gpus.broken = False
            gpus.unhealthy.add("GPU-a")  # the loop lives on and sees the next change
            health = {d.ID: d.health for d in next(stream).devices}
            assert health["GPU-a::0"] == "Unhealthy" and health["GPU-b::0"] == "Healthy"
            stream.cancel()
    finally:
        kubelet.stop()


def allocate(plugin: DevicePlugin, *devices: list[str]) -> list[Any]:
    for client in stub(plugin):
        response = client.Allocate(
            pb.AllocateRequest(
                container_requests=[pb.ContainerAllocateRequest(devices_ids=d) for d in devices]
            ),
            timeout=WAIT,
        )
    return list(response.container_responses)


def test_allocate_injects_the_hook_the_socket_directory_and_the_gpus(
    plugin: DevicePlugin, host: Path
) -> None:
    plugin.start()
    for client in stub(plugin):
        response = client.Allocate(
            pb.AllocateRequest(
                container_requests=[
                    pb.ContainerAllocateRequest(devices_ids=["GPU-b::1", "GPU-a::0", "GPU-b::2"]),
                    pb.ContainerAllocateRequest(devices_ids=["GPU-a::3"]),
                ]
            ),
            timeout=WAIT,
        )
    first, second = response.container_responses
    assert dict(first.envs) == {
        "LD_PRELOAD": "/usr/local/nvshare/lib/libnvshare.so",
        "NVIDIA_VISIBLE_DEVICES": "GPU-b,GPU-a",
        "NVSHARE_SOCKET_DIR": "/var/run/nvshare",
    }
    assert second.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-a"
    mounts = {m.host_path: (m.container_path, m.read_only) for m in first.mounts}
    preload = host / "lib" / "ld.so.preload"
    assert mounts == {
        str(host / "lib" / "libnvshare.so"): ("/usr/local/nvshare/lib/libnvshare.so", True),
        "/var/run/nvshare": ("/var/run/nvshare", True),
        # glibc's loader reads it for every program, whatever LD_PRELOAD the pod sets
        str(preload): ("/etc/ld.so.preload", True),
    }
    assert preload.read_text() == "/usr/local/nvshare/lib/libnvshare.so\n"
    assert not any(m.host_path.endswith(".sock") for m in first.mounts)
    assert not first.cdi_devices  # no CDI spec on this node: NVIDIA_VISIBLE_DEVICES only


NVIDIA_CDI_SPEC = """\
cdiVersion: 0.5.0
kind: nvidia.com/gpu
devices:
{names}
containerEdits:
  deviceNodes: [{{path: /dev/nvidiactl}}]
"""


def cdi_spec(path: Path, *names: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    listed = "\n".join(f"  - name: {n!r}\n    containerEdits: {{}}" for n in names)
    path.write_text(NVIDIA_CDI_SPEC.format(names=listed), encoding="utf-8")


def test_allocate_names_cdi_devices_where_the_node_has_nvidia_cdi_specs(
    plugin: DevicePlugin, host: Path
) -> None:
    plugin.start()
    (host / "etc-cdi").mkdir()
    (host / "etc-cdi" / "broken.yaml").write_text("kind: [", encoding="utf-8")
    cdi_spec(host / "run-cdi" / "nvidia.yaml", "GPU-a", "GPU-b", "all")
    first, second = allocate(plugin, ["GPU-b::1", "GPU-a::0"], ["GPU-a::2"])
    assert [d.name for d in first.cdi_devices] == ["nvidia.com/gpu=GPU-b", "nvidia.com/gpu=GPU-a"]
    assert [d.name for d in second.cdi_devices] == ["nvidia.com/gpu=GPU-a"]
    assert first.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-b,GPU-a"  # the fallback stays
    # A spec that names GPUs by index (nvidia-ctk's default) works through NVML's index.
    cdi_spec(host / "run-cdi" / "nvidia.yaml", "0", "1")
    (by_index,) = allocate(plugin, ["GPU-b::0"])
    assert [d.name for d in by_index.cdi_devices] == ["nvidia.com/gpu=1"]
    # A GPU the spec does not name: no CDI at all for that container, the env var decides.
    cdi_spec(host / "run-cdi" / "nvidia.yaml", "GPU-a")
    (partial,) = allocate(plugin, ["GPU-a::1", "GPU-b::1"])
    assert not partial.cdi_devices


@pytest.mark.parametrize(
    "socket_name",
    [
        "nvidia-gpu.sock",  # NVIDIA's plugin, nvidia.com/gpu
        "nvidia-gpu.shared.sock",  # time-slicing with renameByDefault
        "nvidia-a100.sock",  # a resource its config renamed
    ],
)
def test_nvidia_device_plugin_on_the_node_withdraws_every_device(
    tmp_path: Path, plugin: DevicePlugin, caplog: pytest.LogCaptureFixture, socket_name: str
) -> None:
    plugin.start()
    for client in stub(plugin):
        stream = client.ListAndWatch(pb.Empty(), timeout=WAIT)
        assert {d.health for d in next(stream).devices} == {"Healthy"}
        (tmp_path / socket_name).touch()  # NVIDIA's plugin registers here
        assert {d.health for d in next(stream).devices} == {"Unhealthy"}
        assert "nvidia.com/gpu.deploy.device-plugin=false" in caplog.text
        assert socket_name in caplog.text
        (tmp_path / socket_name).unlink()
        assert {d.health for d in next(stream).devices} == {"Healthy"}
        stream.cancel()


def test_nvidia_mig_sockets_do_not_withdraw_the_devices(
    tmp_path: Path, plugin: DevicePlugin
) -> None:
    """NVIDIA's plugin serves MIG devices on nvidia-mig-<profile>.sock; those GPUs are in MIG
    mode, which this plugin never advertises, so nothing is booked twice."""
    (tmp_path / "nvidia-mig-1g.10gb.sock").touch()
    plugin.start()
    for client in stub(plugin):
        stream = client.ListAndWatch(pb.Empty(), timeout=WAIT)
        assert {d.health for d in next(stream).devices} == {"Healthy"}
        stream.cancel()


def test_allocate_of_a_device_id_we_never_advertised_is_an_invalid_argument(
    plugin: DevicePlugin,
) -> None:
    plugin.start()
    for client in stub(plugin):
        with pytest.raises(grpc.RpcError) as error:
            client.Allocate(
                pb.AllocateRequest(
                    container_requests=[pb.ContainerAllocateRequest(devices_ids=["nvidia0"])]
                ),
                timeout=WAIT,
            )
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "nvidia0" in error.value.details()


def test_preferred_allocation_goes_to_the_least_loaded_gpu_and_honours_must_include(
    plugin: DevicePlugin,
) -> None:
    plugin.start()
    available = [f"GPU-{g}::{n}" for g in "ab" for n in range(4)]

    def ask(size: int, must_include: list[str]) -> list[str]:
        for client in stub(plugin):
            response = client.GetPreferredAllocation(
                pb.PreferredAllocationRequest(
                    container_requests=[
                        pb.ContainerPreferredAllocationRequest(
                            available_deviceIDs=available,
                            must_include_deviceIDs=must_include,
                            allocation_size=size,
                        )
                    ]
                ),
                timeout=WAIT,
            )
        return list(response.container_responses[0].deviceIDs)

    assert ask(1, []) == ["GPU-b::0"]  # GPU-a has 3 clients, GPU-b none
    assert ask(2, []) == ["GPU-b::0", "GPU-a::0"]  # two devices: two GPUs
    assert ask(2, ["GPU-a::2"]) == ["GPU-a::2", "GPU-b::0"]
    assert ask(3, []) == ["GPU-b::0", "GPU-a::0", "GPU-b::1"]


def test_preferred_devices_packs_a_gpu_only_when_it_must() -> None:
    available = ["GPU-a::0", "GPU-a::1", "GPU-a::2"]
    assert preferred_devices(available=available, must_include=[], size=2, load={}) == [
        "GPU-a::0",
        "GPU-a::1",
    ]


@pytest.mark.parametrize("wipes_plugin_sockets", [True, False])
def test_re_registers_and_serves_again_after_a_kubelet_restart(
    tmp_path: Path, plugin: DevicePlugin, wipes_plugin_sockets: bool
) -> None:
    kubelet = FakeKubelet(tmp_path)
    plugin.start()
    assert kubelet.requests.get(timeout=WAIT).endpoint == "nvshare.sock"
    # A kubelet restart: its socket goes away, it (usually) wipes the plugin sockets, then
    # it comes back.
    kubelet.stop()
    (tmp_path / "kubelet.sock").unlink(missing_ok=True)
    if wipes_plugin_sockets:
        plugin.socket_path.unlink()
    restarted = FakeKubelet(tmp_path)
    try:
        assert restarted.requests.get(timeout=WAIT).resource_name == "nvshare.com/gpu"
        for client in stub(plugin):
            options = client.GetDevicePluginOptions(pb.Empty(), timeout=WAIT, wait_for_ready=True)
        assert options.get_preferred_allocation_available
    finally:
        restarted.stop()


def test_a_plugin_started_before_kubelet_registers_when_kubelet_appears(
    tmp_path: Path, plugin: DevicePlugin
) -> None:
    plugin.start()
    assert not (tmp_path / "kubelet.sock").exists()
    kubelet = FakeKubelet(tmp_path)
    try:
        assert kubelet.requests.get(timeout=WAIT).version == "v1beta1"
    finally:
        kubelet.stop()


def test_a_missing_kubelet_directory_is_a_clear_error(tmp_path: Path, gpus: Gpus) -> None:
    plugin = DevicePlugin(
        gpus=gpus.inventory,
        health=gpus.healthy,
        replicas_per_gpu=2,
        resource_name="nvshare.com/gpu",
        kubelet_dir=tmp_path / "device-plugins",
        hook_host_path="/var/lib/nvshare/lib/libnvshare.so",
        socket_host_dir="/var/run/nvshare",
        load=dict,
    )
    with pytest.raises(FileNotFoundError, match=r"device-plugins directory .* does not exist"):
        plugin.start()
    plugin.stop()
