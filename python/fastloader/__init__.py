"""fastloader: torch's DataLoader with a C core.

    from fastloader import DataLoader   # was: from torch.utils.data import DataLoader
"""
__version__ = "0.1.0"   # the only place the version is written (pyproject reads it)

try:
    from . import _codec_hooks  # noqa: F401  (registers the codec with the C core)
    from ._core import FastLoaderError, WorkerError
    from .collated import CollatedSamples
    from .dataloader import DataLoader
    from .install import FastLoaderWarning, install, installed, uninstall
    from .metadata_warning import HeavyMetadataWarning
    from .packed import PackedArray, PackedFormatError, PackedStringArray
    from .packed_dataset import PackedImageFolder
    from .install import install_from_environment as _install_from_environment

    _install_from_environment()   # FASTLOADER_INSTALL=1: see install.py
except ImportError as _exc:   # pragma: no cover - a broken build
    # Keep the package importable so that `python -m fastloader doctor` can say
    # what is wrong; everything else raises this error when used.
    _CORE_IMPORT_ERROR = _exc

    def __getattr__(name):
        raise ImportError(f"fastloader's C extension failed to import "
                          f"({_CORE_IMPORT_ERROR}); reinstall with `pip install .` or run "
                          "`python -m fastloader doctor`") from _CORE_IMPORT_ERROR

__all__ = ["DataLoader", "CollatedSamples", "FastLoaderError", "WorkerError", "PackedStringArray",
           "PackedArray", "PackedFormatError", "PackedImageFolder", "HeavyMetadataWarning",
           "FastLoaderWarning", "install", "uninstall", "installed", "__version__"]
