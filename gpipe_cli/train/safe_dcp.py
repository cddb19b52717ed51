"""torch.distributed.checkpoint, read without ever unpickling arbitrary objects."""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem

# DCP itself reads `.metadata` with plain pickle and non-tensor items with torch.load(weights_only=False): either
# would run code hidden in a crafted checkpoint.
_METADATA_FILE = ".metadata"
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_ALLOWED = {
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}


class UnsafeCheckpoint(pickle.UnpicklingError):
    """A checkpoint whose metadata names something other than checkpoint metadata."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _DCP_MODULES:
            found = getattr(__import__(module, fromlist=[name]), name, None)
            if isinstance(found, type) and found.__module__ == module:  # classes defined there, nothing imported
                return found
        elif name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpoint(f"the checkpoint metadata refers to {module}.{name}, which a checkpoint never holds")


class SafeReader(FileSystemReader):
    """A FileSystemReader whose metadata is unpickled with an allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with open(Path(self.path) / _METADATA_FILE, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpoint("the checkpoint metadata is not DCP metadata")
        storage = getattr(metadata, "storage_meta", None)
        if storage is not None and hasattr(self, "load_id"):
            storage.load_id = self.load_id
        return metadata


def saved_keys(path: Path) -> set[str] | None:
    """The flattened keys a checkpoint folder holds (None: its metadata does not pass the safe reader)."""
    try:
        return set(SafeReader(str(path)).read_metadata().state_dict_metadata)
    except Exception:  # whatever stops it reading stops the ranks loading it
        return None


class SafeLoadPlanner(DefaultLoadPlanner):
    """The default load planner, but non-tensor items are loaded with weights_only=True."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        checked = torch.load(value, weights_only=True)  # raises on anything but plain data
        again = io.BytesIO()
        torch.save(checked, again)
        again.seek(0)
        super().load_bytes(read_item, again)
