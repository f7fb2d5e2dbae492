"""Resolving the context-parallel (CP) process group.

Every public function takes ``group=None | ProcessGroup | DeviceMesh``. This module
turns that into a :class:`CPGroup`: the process group (or ``None`` when no
distributed run is active), this rank's index in it and its size. A CP group of
size 1 is the single-device case and never issues a collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist


@dataclass(frozen=True)
class CPGroup:
    """The CP group as the ring sees it: ``pg`` is ``None`` when size is 1 without a group."""

    pg: Optional[dist.ProcessGroup]
    rank: int
    size: int

    @property
    def name(self) -> str:
        """The registered group name (what custom ops carry instead of the object)."""
        if self.pg is None:
            return ""
        return self.pg.group_name


def _from_mesh(mesh: Any) -> dist.ProcessGroup:
    if mesh.ndim == 1:
        return mesh.get_group()
    names = mesh.mesh_dim_names or ()
    if "cp" not in names:
        raise ValueError(
            f"cp_compile: the DeviceMesh has {mesh.ndim} dims named {names}, none named 'cp'. "
            "Fix: pass mesh['cp'] (name the context-parallel dim 'cp') or a 1-D mesh."
        )
    return mesh.get_group("cp")


def resolve_group(group: Any = None) -> CPGroup:
    """Return the CP group for ``group``.

    ``None`` means the default (WORLD) group, or size 1 when torch.distributed is not
    initialised. A ``DeviceMesh`` contributes its 1-D group or its dim named ``"cp"``.
    Passing an explicit group while torch.distributed is not initialised is an error.
    """
    initialised = dist.is_available() and dist.is_initialized()
    if group is None:
        if not initialised:
            return CPGroup(pg=None, rank=0, size=1)
        pg = dist.group.WORLD
    else:
        if not initialised:
            raise RuntimeError(
                "cp_compile: a process group was given but torch.distributed is not "
                "initialised. Fix: call torch.distributed.init_process_group(...) first "
                "(e.g. launch with torchrun), or pass group=None for a single process."
            )
        from torch.distributed.device_mesh import DeviceMesh

        pg = _from_mesh(group) if isinstance(group, DeviceMesh) else group
        if not isinstance(pg, dist.ProcessGroup):
            raise TypeError(
                f"cp_compile: group must be None, a ProcessGroup or a DeviceMesh, got "
                f"{type(group).__name__}."
            )
    return CPGroup(pg=pg, rank=dist.get_rank(pg), size=dist.get_world_size(pg))


def group_by_name(name: str) -> CPGroup:
    """Inverse of :attr:`CPGroup.name` (used inside custom ops)."""
    if not name:
        return CPGroup(pg=None, rank=0, size=1)
    from torch.distributed.distributed_c10d import _resolve_process_group

    pg = _resolve_process_group(name)
    return CPGroup(pg=pg, rank=dist.get_rank(pg), size=dist.get_world_size(pg))
