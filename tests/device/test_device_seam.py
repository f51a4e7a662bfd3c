"""The device seam stays narrow: few public verbs on Device, no type checks of devices."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

import mmcache
from mmcache.device import DONE, CopyPlan, Device, NewCopyPlan, SimDevice
from mmcache.errors import InvalidValueError

CONCRETE_DEVICES = {"SimDevice", "CudaDevice"}


def public_methods(cls: type) -> list[str]:
    """Methods and properties defined on cls and its bases, not private, not dunder."""
    names = set()
    for klass in cls.__mro__:
        if klass is object:
            continue
        for name, member in vars(klass).items():
            if name.startswith("_"):
                continue
            if isinstance(member, (property, staticmethod, classmethod)) or inspect.isfunction(
                member
            ):
                names.add(name)
    return sorted(names)


def test_device_has_at_most_16_public_methods() -> None:
    methods = public_methods(Device)
    assert "submit" in methods
    assert len(methods) <= 16, methods


def test_devices_say_their_kind() -> None:
    assert SimDevice.kind == "sim"
    from mmcache.device import cuda  # importable without a GPU

    assert cuda.CudaDevice.kind == "cuda"


def _isinstance_of_a_device(node: ast.Call) -> str | None:
    if not (isinstance(node.func, ast.Name) and node.func.id == "isinstance"):
        return None
    if len(node.args) != 2:
        return None
    for sub in ast.walk(node.args[1]):
        name = (
            sub.id
            if isinstance(sub, ast.Name)
            else sub.attr
            if isinstance(sub, ast.Attribute)
            else None
        )
        if name in CONCRETE_DEVICES:
            return name
    return None


#: Modules still checking a device's type, until they read device.kind: this only shrinks.
def test_no_module_outside_the_device_layer_checks_a_device_type() -> None:
    root = Path(mmcache.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.is_relative_to(root / "device"):
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and (name := _isinstance_of_a_device(node)):
                found.append(f"{path.relative_to(root)}:{node.lineno} isinstance(..., {name})")
    assert not found, found


def test_submit_refuses_a_plan_it_cannot_route() -> None:
    dev = SimDevice()
    try:
        src, dst = dev.empty((4,), torch.float32), dev.empty((4,), torch.float32)
        with pytest.raises(InvalidValueError, match="stream"):
            dev.submit(CopyPlan("d2d", (src,), (dst,)))  # a d2d copy needs its stream
        with pytest.raises(InvalidValueError, match="copy stream"):
            dev.submit(CopyPlan("h2d", (src,), (dst,), stream=dev.current_stream()))
        with pytest.raises(InvalidValueError, match="direction"):
            dev.submit(CopyPlan("x2y", (src,), (dst,)))  # type: ignore[arg-type]
        with pytest.raises(InvalidValueError, match="one source"):
            dev.submit(NewCopyPlan("h2d", (src, dst)))
    finally:
        dev.close()


def test_new_copies_by_direction() -> None:
    dev = SimDevice()
    try:
        stream = dev.current_stream()
        host = torch.arange(8, dtype=torch.float32)
        up, fence = dev.submit(NewCopyPlan("h2d", (host,), after=(DONE,)))
        assert fence is not None and fence.wait(5)
        assert torch.equal(up, host)
        down, fence = dev.submit(NewCopyPlan("d2h", (up,)))
        assert fence is not None and fence.wait(5)
        assert torch.equal(down, host)
        rows, fence = dev.submit(NewCopyPlan("d2d", (up[:3], up[5:]), rows=True, stream=stream))
        assert fence is not None and fence.wait(5)
        assert torch.equal(rows, torch.tensor([0.0, 1, 2, 5, 6, 7]))
        parts = (host[:2].view(torch.uint8), host[4:6].view(torch.uint8))  # flat bytes
        plan = NewCopyPlan("h2d", parts, (32,), offsets=(0, 16), stream=stream)
        packed, fence = dev.submit(plan)
        assert fence is not None and fence.wait(5)
        floats = packed.view(torch.float32)
        assert torch.equal(floats[:2], host[:2]) and torch.equal(floats[4:6], host[4:6])
        for t in (up, rows, packed):
            dev.release(t, after=())
    finally:
        dev.close()
