"""jaxtrain's release (CHANGELOG.md): pyproject.toml reads it, ``jaxtrain.__version__`` and ``jaxtrain --version``
say it."""

__version__ = "0.2.0"
