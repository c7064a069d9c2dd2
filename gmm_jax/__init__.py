"""gmm_jax: grouped matrix multiplication (GroupedGEMM) for JAX.

This file is the whole public API.
"""

import importlib.abc as _abc
import importlib.util as _util
import os as _os
import sys as _sys


class _CheckoutKernels(_abc.MetaPathFinder):
    """Finds `gmm_jax.pallas` in a source checkout run without installing.

    An installed package holds the kernels as `gmm_jax/pallas`; a checkout on
    PYTHONPATH holds them at the top level as `pallas/` (pyproject's
    package-dir mapping). This finder maps the one name, and only when the
    package's own folder lacks it, so a checkout imports its own kernels
    rather than an editable install's or none.
    """

    def __init__(self, folder):
        self.folder = folder

    def find_spec(self, name, path=None, target=None):
        if name != "gmm_jax.pallas":
            return None
        return _util.spec_from_file_location(
            name, _os.path.join(self.folder, "__init__.py"),
            submodule_search_locations=[self.folder])


def _checkout_kernels():
    here = _os.path.dirname(_os.path.abspath(__file__))
    root = _os.path.dirname(here)
    folder = _os.path.join(root, "pallas")
    if _os.path.isdir(_os.path.join(here, "pallas")):
        return None
    if not (_os.path.isfile(_os.path.join(folder, "__init__.py"))
            and _os.path.isfile(_os.path.join(root, "pyproject.toml"))):
        return None
    return _CheckoutKernels(folder)


if (_finder := _checkout_kernels()) is not None:
    _sys.meta_path.insert(0, _finder)

from gmm_jax._src.explain import explain as explain
from gmm_jax._src.api import gmm as gmm
from gmm_jax._src.tiling.autotune import TuneResult as TuneResult
from gmm_jax._src.tiling.autotune import autotune as autotune
from gmm_jax._src.core.config import GmmConfig as GmmConfig
from gmm_jax._src.core.config import Problem as Problem
from gmm_jax._src.core.config import Tiling as Tiling
from gmm_jax._src.core.config import Tilings as Tilings
from gmm_jax._src.backends.registry import implementations as implementations
from gmm_jax._src.core.epilogue import ACTIVATIONS as ACTIVATIONS
from gmm_jax._src.core.group_list import check_group_list as check_group_list
from gmm_jax._src.core.grouped_array import GroupedArray as GroupedArray
from gmm_jax._src.core.grouped_array import GroupedDesc as GroupedDesc
from gmm_jax._src.core.grouped_array import grouped_desc as grouped_desc
from gmm_jax._src.core.errors import GmmShapeError as GmmShapeError
from gmm_jax._src.core.grouped_array import MaskedArray as MaskedArray
from gmm_jax._src.core.grouped_array import from_ragged as from_ragged
from gmm_jax._src.core.grouped_array import to_ragged as to_ragged
from gmm_jax._src.core.metadata import TileMetadata as TileMetadata
from gmm_jax._src.op import PREACTIVATION as PREACTIVATION
from gmm_jax._src.core.metadata import make_tile_metadata as make_tile_metadata
from gmm_jax._src.core.qarray import Fp8Training as Fp8Training
from gmm_jax._src.core.qarray import QArray as QArray
from gmm_jax._src.core.qarray import QuantSpec as QuantSpec
from gmm_jax._src.core.qarray import dequantize as dequantize
from gmm_jax._src.core.qarray import quantize as quantize
from gmm_jax._src.ragged_dot import ragged_dot as ragged_dot
from gmm_jax._src.ragged_dot import ragged_dot_general as ragged_dot_general
from gmm_jax._src.moe.routing import Routing as Routing
from gmm_jax._src.moe.experts import ExpertFFN as ExpertFFN
from gmm_jax._src.moe.partitioned import routed_experts as routed_experts
from gmm_jax._src.moe.routing import route as route
from gmm_jax._src.moe.routing import routed_apply as routed_apply
from gmm_jax._src.moe.routing import routed_gmm as routed_gmm
from gmm_jax._src.sharding.spec import GmmSharding as GmmSharding

__version__ = "0.1.0"

# The public names: every re-export above (`__version__` is metadata, not API).
__all__ = [
    "ACTIVATIONS",
    "autotune",
    "check_group_list",
    "dequantize",
    "explain",
    "Fp8Training",
    "from_ragged",
    "gmm",
    "GmmConfig",
    "GmmShapeError",
    "GmmSharding",
    "grouped_desc",
    "GroupedArray",
    "GroupedDesc",
    "implementations",
    "make_tile_metadata",
    "MaskedArray",
    "PREACTIVATION",
    "Problem",
    "QArray",
    "quantize",
    "QuantSpec",
    "ragged_dot",
    "ragged_dot_general",
    "ExpertFFN",
    "route",
    "routed_experts",
    "routed_apply",
    "routed_gmm",
    "Routing",
    "TileMetadata",
    "to_ragged",
    "Tiling",
    "Tilings",
    "TuneResult",
]
