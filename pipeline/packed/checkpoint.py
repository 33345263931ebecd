"""Reading safetensors checkpoints one tensor at a time.

A Hugging Face model directory holds ``model.safetensors`` or shards listed in
``model.safetensors.index.json``; tensor names there are the checkpoint's names (for Mllama,
``language_model.model.layers.0...``), which transformers maps to module names on load. Files of this
project (fitted states, packed models) use the checkpoint names, so that the 11B model's tensors can
be streamed without ever building the model; :func:`module_to_checkpoint_names` gives the mapping.

Writing goes through :mod:`pipeline.packed.safetensors_io`.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import torch
from safetensors import safe_open

from pipeline.packed.safetensors_io import TORCH_DTYPES, PrivateReader



def check_regular_file(path: str | os.PathLike, what: str = "file") -> Path:
    """``path`` as a Path if it is a regular file; otherwise a ``FileNotFoundError`` (nothing there) or
    a ``ValueError`` (a directory, FIFO, socket, device...) naming it. Uses ``os.stat`` only, so a FIFO
    is refused without being opened (opening one blocks until a writer appears)."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: {what} not found") from None
    except OSError as e:
        raise ValueError(f"{path}: {what} cannot be examined ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file (FIFO, socket or device)"
        raise ValueError(f"{path}: {what} is {kind}")
    return path


class CheckpointReader:
    """Lazy access to the tensors of a model directory or a single ``.safetensors`` file.

    Anything that is not a readable safetensors file (a missing path, a directory without
    ``model.safetensors``, a FIFO or device, a truncated file, a corrupt header or index) is refused
    when the reader is made, with one ``FileNotFoundError`` / ``ValueError`` naming the file.

    ``private=True``: each tensor read into private memory (:class:`~pipeline.packed.safetensors_io.PrivateReader`) rather
    than mapped from the file: what a model that keeps its weights for its lifetime (the runtime's) wants."""

    def __init__(self, path: str | os.PathLike, private: bool = False) -> None:
        path = Path(path)
        try:
            is_dir = stat.S_ISDIR(os.stat(path).st_mode)
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: checkpoint not found") from None
        except OSError as e:
            raise ValueError(f"{path}: checkpoint cannot be examined ({e.strerror or e})") from None
        files = None
        if is_dir:
            index = path / "model.safetensors.index.json"
            single = path / "model.safetensors"
            if os.path.lexists(index):
                files = self._read_index(path, check_regular_file(index, "checkpoint index"))
            elif os.path.lexists(single):
                path = single
            else:
                raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
        self.path = path
        self._handles: dict[Path, object] = {}
        self._private: dict[Path, PrivateReader] | None = {} if private else None
        if files is None:
            handle = self._open(check_regular_file(path, "checkpoint"))
            self._files = {name: path for name in handle.keys()}
        else:
            for shard in sorted(set(files.values())):
                have = set(self._open(check_regular_file(shard, "checkpoint shard")).keys())
                lacking = sorted(n for n, f in files.items() if f == shard and n not in have)
                if lacking:
                    raise ValueError(f"{shard}: the index lists tensors this shard lacks, e.g. {lacking[:3]}")
            self._files = files

    @staticmethod
    def _read_index(directory: Path, index: Path) -> dict[str, Path]:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError, RecursionError, UnicodeDecodeError) as e:
            raise ValueError(f"{index}: not a checkpoint index (no readable 'weight_map': {type(e).__name__})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                       for k, v in weight_map.items()):
            raise ValueError(f"{index}: 'weight_map' must map tensor names to shard file names")
        root = directory.resolve()
        files = {}
        for name, shard in weight_map.items():
            file = directory / shard
            if not file.resolve().is_relative_to(root):
                raise ValueError(f"{index}: tensor {name!r} points outside the checkpoint directory ({shard!r})")
            files[name] = file
        return files

    def _open(self, file: Path):
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(file), framework="pt")
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise ValueError(f"{file}: not a readable safetensors file ({e})") from None
        return self._handles[file]

    def keys(self) -> list[str]:
        return list(self._files)

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def get(self, name: str, mapped: bool = False) -> torch.Tensor:
        """The tensor ``name``; ``mapped`` (private readers only): over a copy-on-write map of the file, pages
        coming in as they are touched (:meth:`PrivateReader.get`)."""
        if name not in self._files:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        # a handle of its own, dropped at once: the tensor alone keeps its pages mapped, so they leave the
        # process's memory with it (a cached handle would keep every page ever read resident: the whole checkpoint)
        file = self._files[name]
        self._open(file)                   # a readable file, or the one-line error
        if self._private is not None:
            if file not in self._private:
                self._private[file] = PrivateReader(file)
            return self._private[file].get(name, mapped)
        try:
            with safe_open(str(file), framework="pt") as f:
                return f.get_tensor(name)
        except Exception as e:
            raise ValueError(f"{self._files[name]}: cannot read tensor {name!r} ({e})") from None

    def drop_mapped(self) -> None:
        """Hand back the pages of the mapped tensors touched so far (:meth:`PrivateReader.drop_mapped`)."""
        for reader in (self._private or {}).values():
            reader.drop_mapped()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(self._files[name]).get_slice(name).get_shape())

    def dtype_name(self, name: str) -> str:
        """The tensor's dtype as its header spells it (``"BF16"``, ``"U8"`` ...), read without loading it."""
        return str(self._open(self._files[name]).get_slice(name).get_dtype())

    def dtype(self, name: str) -> torch.dtype | None:
        """The tensor's torch dtype from its header (None for a dtype this project never writes)."""
        return TORCH_DTYPES.get(self.dtype_name(name))

    def nbytes(self, name: str) -> int:
        """Bytes the tensor takes, from its header."""
        dtype = self.dtype(name)
        size = torch.empty(0, dtype=dtype).element_size() if dtype is not None else 1
        return int(torch.Size(self.shape(name)).numel()) * size

    def file_of(self, name: str) -> Path:
        return self._files[name]

    def metadata(self) -> dict[str, str]:
        first = next(iter(self._files.values()), None)
        return dict(self._open(first).metadata() or {}) if first else {}


def module_to_checkpoint_names(model: torch.nn.Module) -> dict[str, str]:
    """``{state-dict name in the model: name in a saved checkpoint}`` for every parameter/buffer,
    using the renaming transformers applies in ``save_pretrained``."""
    from transformers.core_model_loading import revert_weight_conversion

    names = list(model.state_dict().keys())
    tagged = {name: torch.tensor([i]) for i, name in enumerate(names)}
    reverted = revert_weight_conversion(model, tagged)
    mapping = {names[int(t[0])]: saved for saved, t in reverted.items()}
    if len(mapping) != len(names):
        raise RuntimeError("checkpoint renaming is not one-to-one for this model")
    return mapping
