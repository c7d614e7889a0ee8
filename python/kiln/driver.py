"""Devices and tensors: ``CPU()``, ``Tensor`` (DLPack both ways, zero-copy)."""
from kiln._kiln.driver import CPU, Tensor, accelerator_count, from_dlpack
from kiln._kiln.graph import DeviceRef as Device

__all__ = ["CPU", "Device", "Tensor", "accelerator_count", "from_dlpack"]
