"""
Reading a DCP checkpoint without running code from it: torch.distributed.checkpoint's file reader,
its .metadata index unpickled with an allowlist of DCP's own metadata classes, and a load planner
that refuses non-tensor entries. infra/checkpoint.py reads every checkpoint through these (load, resume,
load_weights, read_tensors, and damage's check of the files .metadata points into).

    md = Reader(path).read_metadata()   # DCP's Metadata; a crafted .metadata: UnpicklingError
    dcp.load(state, storage_reader=Reader(path), planner=Planner(allow_partial_load=True))

Where this differs from DCP's FileSystemReader and DefaultLoadPlanner, and why:
- DCP unpickles .metadata with pickle.load: a file on disk that names a callable runs it. Here only
  DCP's metadata dataclasses and the few torch and builtin types they hold are admitted, by exact
  (module, name): no prefix and no dotted name (find_class would walk 'os.system' through a module
  DCP imports), and no function but two stand-ins of our own, for the way torch pickles a layout and
  the way some Pythons (3.11.2) pickle an enum member (getattr(EnumClass, 'NAME')).
- nothing non-tensor is saved (infra/checkpoint.py keeps that state in loop.json), so a non-tensor entry
  is refused, not unpickled as DCP's planner would.

Tested by: python -m pytest tests/test_checkpoint.py -k metadata
"""
import os
import pickle

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING


class SafeUnpickler(pickle.Unpickler):
    # DCP's .metadata is a pickle of its own dataclasses: admit exactly those and the few torch and
    # builtin types they hold, by (module, name), nothing else: no prefix, no dotted name (find_class
    # would walk it: 'torch.distributed.checkpoint.filesystem' + 'os.system'), no function but two
    # stand-ins of our own (no arbitrary code from a file on disk)
    def find_class(self, module, name):
        if (module, name) in _SAFE or (module == 'torch' and '.' not in name and
                                       isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        if (module, name) == ('torch.serialization', '_get_layout'):  # how torch pickles a layout
            return _layout
        if (module, name) == ('builtins', 'getattr'):  # some Pythons (3.11.2) pickle an enum member
            return _enum_member                          # as getattr(EnumClass, 'NAME')
        raise pickle.UnpicklingError(f'{module}.{name} is not allowed in a DCP .metadata file')


def _layout(name):
    # torch.serialization._get_layout without its reach: a layout by its str ('torch.strided')
    layouts = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
    if name not in layouts:
        raise pickle.UnpicklingError(f'{name!r} is not a torch layout')
    return layouts[name]


def _enum_member(cls, name):
    # getattr limited to a member of one of DCP's own enums (its memory-format encoding)
    if cls in _ENUMS and name in cls.__members__:
        return cls[name]
    raise pickle.UnpicklingError(f'getattr({cls!r}, {name!r}) is not allowed in a DCP .metadata file')


_ENUMS = (_MEM_FORMAT_ENCODING,)
_SAFE = {('torch.distributed.checkpoint.metadata', c) for c in (
             'Metadata', 'StorageMeta', 'MetadataIndex', 'TensorStorageMetadata', 'BytesStorageMetadata',
             'ChunkStorageMetadata', 'TensorProperties', '_MEM_FORMAT_ENCODING')} | \
        {('torch.distributed.checkpoint.filesystem', '_StorageInfo'), ('torch', 'Size'),
         ('collections', 'OrderedDict'), ('builtins', 'set'), ('builtins', 'frozenset')} | \
        {(m, c) for m in ('pathlib', 'pathlib._local') for c in ('PosixPath', 'WindowsPath')}  # checkpoint_id


class Reader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        with open(os.path.join(self.path, '.metadata'), 'rb') as f:
            md = SafeUnpickler(f).load()
        if getattr(md, 'storage_meta', None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class Planner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value):  # nothing non-tensor is saved (DCP would unpickle it)
        raise ValueError(f'unexpected non-tensor entry {read_item.dest_index.fqn} in a checkpoint')
