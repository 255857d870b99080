"""Backend registry: auto picks by device presence, plug-ins load by entry point, nothing falls back silently."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from portapipe.backends import BackendUnavailable, get_backend, registry
from portapipe.backends.cpu import CPUBackend


class _EntryPoint:
    def __init__(self, name: str, obj: Any) -> None:
        self.name, self._obj = name, obj

    def load(self) -> Any:
        return self._obj


class PluginBackend(CPUBackend):
    name = "myaccel"


class AbsentBackend(CPUBackend):
    name = "ghost"
    install_hint = "Install the ghost driver (pip install ghost-accel)."

    @classmethod
    def is_available(cls) -> bool:
        return False

    @classmethod
    def device_present(cls) -> bool:
        return False


@pytest.fixture()
def plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    found = {"myaccel": _EntryPoint("myaccel", PluginBackend), "ghost": _EntryPoint("ghost", AbsentBackend),
             "broken": _EntryPoint("broken", object)}
    monkeypatch.setattr(registry, "_plugins", lambda: found)


def test_auto_picks_a_present_device_and_logs_once(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(registry, "device_present", lambda name: name == "cpu")
    monkeypatch.setattr(registry, "_auto_logged", False)
    with caplog.at_level(logging.INFO, logger="portapipe.backends"):
        assert registry.resolve_name("auto") == "cpu"
        assert registry.resolve_name("auto") == "cpu"
    messages = [r.getMessage() for r in caplog.records if "backend auto" in r.getMessage()]
    assert messages == ["backend auto: found a cpu device, using backend 'cpu'"]


def test_auto_prefers_an_accelerator_and_never_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    # A GPU is present but its software is not usable: auto must say so, not quietly use the CPU.
    monkeypatch.setattr(registry, "device_present", lambda name: name in ("cuda", "cpu"))
    cuda = registry.backend_class("cuda")
    monkeypatch.setattr(cuda, "is_available", classmethod(lambda cls: False))
    assert registry.resolve_name("auto") == "cuda"
    with pytest.raises(BackendUnavailable):
        registry.check_available("auto")


def test_plugins_by_entry_point(plugins: None) -> None:
    assert "myaccel" in registry.known_backends()
    assert isinstance(get_backend("myaccel"), PluginBackend)
    with pytest.raises(BackendUnavailable, match="ghost driver"):
        get_backend("ghost")
    with pytest.raises(registry.PluginError, match="backend: 'broken': the plug-in entry point broken = .* is <class 'object'>, not a portapipe Backend subclass"):
        registry.backend_class("broken")
    info = registry.info()
    assert info["myaccel"]["available"] is True
    assert info["ghost"]["available"] is False and "ghost driver" in info["ghost"]["missing"]
    assert "error" in info["broken"]


def test_unknown_backend_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="known: auto, cpu, cuda, npu"):
        get_backend("tpu")


def test_an_option_the_backend_does_not_read_is_refused_by_name() -> None:
    """A misspelled option (``ep_transprot``) would otherwise run the default silently."""
    assert get_backend("cpu", {"ep_transport": "alltoall"}).options == {"ep_transport": "alltoall"}
    with pytest.raises(ValueError) as err:
        get_backend("cpu", {"ep_transprot": "nvshmem", "buffer": 1})
    assert str(err.value).splitlines() == [
        "backend_options.buffer: not an option of backend 'cpu' (its options: ep_transport)",
        "backend_options.ep_transprot: not an option of backend 'cpu' (its options: ep_transport)",
    ]


class _PluginReadingItsOwnOptions(CPUBackend):
    name = "undeclared"
    option_keys = None  # a plug-in that declares nothing keeps every key


def test_a_plugin_without_declared_options_keeps_every_key() -> None:
    assert _PluginReadingItsOwnOptions({"anything": 1}).options == {"anything": 1}
